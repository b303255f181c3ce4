"""The first data-parallel replica's copy of what every replica keeps its own of.

BatchNorm's running statistics are buffers, not parameters: no gradient all-reduce
keeps them equal, and each rank updates its own from its own batches. DDP copies
data-parallel rank 0's to the others before each forward (`broadcast_buffers`);
FSDP, a pipeline's data-parallel replicas and the data-parallel dimension of a mesh
do not. scaletrain's answer to "what is the model at step N" is DDP's: the buffers
of data-parallel rank 0. Evaluation, `model.pt`, a checkpoint's model (what
`consolidate` returns) and `rt.full_state_dict` read them through this module;
none of them changes any rank's own buffers, which training goes on with, so a run
is the same whether, and whenever, it evaluates or saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.dist.mesh import device_mesh
from scaletrain.dist.topology import Topology

__all__ = ["first_replica_values", "replica_group"]


def replica_group(topology: Topology) -> Any | None:
    """The process group of this rank's data-parallel peers (the ranks that hold the
    same part of the model and see other data); None when it has no peers."""
    if topology.dp_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if topology.mesh_given:
        return device_mesh(topology, "dp").get_group()
    # Without a mesh every rank is a data-parallel peer of every other.
    return dist.group.WORLD


def first_replica_values(tensors: Sequence[torch.Tensor], topology: Topology) -> list[torch.Tensor]:
    """Data-parallel rank 0's values of `tensors`, as new tensors on each one's device.

    Every peer passes its own copies of the same tensors (names, shapes and dtypes
    in the same order). A collective of the data-parallel group, one broadcast per
    dtype however many tensors; with no peers, copies of `tensors` themselves.
    """
    copies = [t.detach().clone() for t in tensors]
    group = replica_group(topology)
    if group is None or not copies:
        return copies
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    # NCCL moves tensors on this process's own GPU; a model spread over several
    # devices (a device map) or a CPU-side copy goes through it.
    comm = topology.device if topology.backend == "nccl" else torch.device("cpu")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, t in enumerate(copies):
        by_dtype.setdefault(t.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        # Gloo has no bool collectives: flags travel as bytes.
        wire = torch.uint8 if dtype == torch.bool else dtype
        flat = torch.cat([copies[i].reshape(-1).to(device=comm, dtype=wire) for i in indices])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in indices:
            n = copies[i].numel()
            copies[i].copy_(flat[offset : offset + n].reshape(copies[i].shape))
            offset += n
    return copies
