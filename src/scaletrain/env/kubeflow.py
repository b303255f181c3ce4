"""Kubeflow PyTorchJob pods: one process per pod, started by the training operator.

The operator gives each pod MASTER_ADDR/MASTER_PORT (the master pod's
service), RANK (the pod's index: master 0, worker i -> i + 1) and WORLD_SIZE.
Those are the names torchrun uses for *processes*; here they count *pods*,
and the launcher starts the per-device workers (`per_node=True`). A pod that
runs torchrun is read by the torchelastic reader first: its workers carry
TORCHELASTIC_RUN_ID / LOCAL_RANK / GROUP_RANK, which this reader refuses.

Since training-operator v1.7, with `nprocPerNode` set, WORLD_SIZE counts
processes (pods x nprocPerNode); PET_NNODES and PET_NPROC_PER_NODE then
give the pod count, and RANK stays the pod index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    Value,
    build_env,
    default_port,
    missing,
    read_int,
    read_master_addr,
    read_master_port,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment
from scaletrain.env.torchelastic import TORCHELASTIC_MARKERS

__all__ = ["KubeflowEnvironment"]

_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_WHY = "the Kubeflow training operator sets it in every PyTorchJob pod"
_FIX = (
    "these variables come from the Kubeflow training operator; run the job as a "
    "PyTorchJob (or, for a manual launch, set MASTER_ADDR, MASTER_PORT, RANK and "
    "WORLD_SIZE consistently: RANK in 0..WORLD_SIZE-1, one value per node)"
)
_DIGITS = re.compile(r"[0-9]+")


class KubeflowEnvironment(ClusterEnvironment):
    """Kubeflow PyTorchJob: rank = pod index, world size = number of pods."""

    name: ClassVar[str] = "kubeflow"
    priority: ClassVar[int] = 40

    def _detect(self, environ: Mapping[str, str]) -> bool:
        if not all(name in environ for name in _REQUIRED):
            return False
        # torchrun exports the same four names per worker; its own markers
        # tell its workers apart from a pod's single process.
        return not any(marker in environ for marker in TORCHELASTIC_MARKERS)

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        reasons = ["MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set without torchrun's markers"]
        evidence = sorted(k for k in environ if k.startswith("PET_"))
        if evidence:
            reasons.append(f"{', '.join(evidence)} set: a Kubeflow PyTorchJob pod")
        if "KUBERNETES_SERVICE_HOST" in environ:
            reasons.append("KUBERNETES_SERVICE_HOST set: running in a Kubernetes pod")
        if not evidence and "KUBERNETES_SERVICE_HOST" not in environ:
            reasons.append("no Kubernetes variables: read as a manual one-process-per-node launch")

        rank = read_int(environ, "RANK", why=_WHY, fix=_FIX)
        world = read_int(environ, "WORLD_SIZE", why=_WHY, fix=_FIX, minimum=1)

        # PET_NPROC_PER_NODE may be "auto" or "gpu"; only a number is a hint,
        # and only a number multiplied WORLD_SIZE (the operator counts the
        # others as 1).
        nproc_raw = environ.get("PET_NPROC_PER_NODE", "").strip()
        nproc = int(nproc_raw) if _DIGITS.fullmatch(nproc_raw) and int(nproc_raw) > 0 else None
        # PET_NNODES is "2" for a fixed job but "1:4" under an elastic policy,
        # and then torchrun does the work; only a plain number is a count.
        nnodes_raw = environ.get("PET_NNODES", "").strip()
        if _DIGITS.fullmatch(nnodes_raw):
            num_nodes = Value(int(nnodes_raw), f"PET_NNODES={nnodes_raw}")
        elif nproc is not None and nproc > 1 and world.value % nproc == 0:
            n = world.value // nproc
            num_nodes = Value(n, f"{n} pods (derived: WORLD_SIZE // PET_NPROC_PER_NODE)")
        else:
            num_nodes = Value(world.value, f"{world.source} pods")
        if num_nodes.value != world.value:
            reasons.append(
                f"{world.source} counts processes (PET_NPROC_PER_NODE={nproc_raw!r} per pod); "
                f"the job has {num_nodes.value} pods"
            )
        reasons.append(f"{rank.source}: pod {rank.value} of {num_nodes.value}")

        addr = read_master_addr(environ)
        if addr is None:
            raise missing("MASTER_ADDR", _WHY, _FIX)
        if not environ.get("MASTER_PORT", "").strip():
            raise missing("MASTER_PORT", _WHY, _FIX)
        # The default is never used: MASTER_PORT was just checked to be set.
        port = read_master_port(environ, default_port(), fix=_FIX)
        reasons.append(f"MASTER_ADDR={addr}, {port.source}")
        # The pod is one process: the launcher starts the workers.
        zero = Value(0, "local rank 0 (one process per pod)")
        one = Value(1, "local world size 1 (one process per pod)")
        return build_env(
            kind=self.name,
            rank=rank,
            local_rank=zero,
            world_size=num_nodes,
            local_world_size=one,
            node_rank=rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            reasons=reasons,
            fix=_FIX,
            per_node=True,
            procs_per_node_hint=nproc,
        )
