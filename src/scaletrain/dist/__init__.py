"""Process groups, this process's topology and meshes, backend and device choice, collectives."""

from scaletrain.dist.backend import BACKENDS, choose_backend, choose_device
from scaletrain.dist.collectives import (
    REDUCE_OPS,
    PendingFlag,
    all_gather_floats,
    any_rank,
    any_rank_async,
    barrier,
    broadcast_object,
    from_rank_zero,
    gather_rows,
    rank_first,
    reduce_values,
)
from scaletrain.dist.grad_norm import clip_grads_, global_grad_norm
from scaletrain.dist.mesh import device_mesh
from scaletrain.dist.process_group import (
    DEFAULT_TIMEOUT_S,
    claim_first,
    destroy,
    init_process_group,
    is_initialized,
)
from scaletrain.dist.sync_batchnorm import SyncBatchNorm
from scaletrain.dist.topology import Topology, parse_mesh

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "REDUCE_OPS",
    "PendingFlag",
    "SyncBatchNorm",
    "Topology",
    "all_gather_floats",
    "any_rank",
    "any_rank_async",
    "barrier",
    "broadcast_object",
    "choose_backend",
    "choose_device",
    "claim_first",
    "clip_grads_",
    "destroy",
    "device_mesh",
    "from_rank_zero",
    "gather_rows",
    "global_grad_norm",
    "init_process_group",
    "is_initialized",
    "parse_mesh",
    "rank_first",
    "reduce_values",
]
