"""A plain single process: `python train.py` on a workstation.

Tried last and always applies. It refuses one case: WORLD_SIZE or RANK
saying there are other processes while no launcher was recognised. Reading
that as rank 0 of 1 would let every copy train alone, each believing it is
the only one, and the mistake would show only in the results.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    LOOPBACK,
    Value,
    build_env,
    default_port,
    malformed,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment

__all__ = ["LocalEnvironment"]

_FIX = (
    "launch several processes with `torchrun --nproc-per-node=<N> train.py` (or "
    "`scaletrain launch`), or for a manual launch set MASTER_ADDR, MASTER_PORT, RANK "
    "and WORLD_SIZE together; to run one process, unset WORLD_SIZE and RANK"
)


class LocalEnvironment(ClusterEnvironment):
    """One process, rank 0 of 1, rendezvous on loopback."""

    name: ClassVar[str] = "local"
    priority: ClassVar[int] = 100

    def _detect(self, environ: Mapping[str, str]) -> bool:
        return True

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        world = read_optional_int(environ, "WORLD_SIZE", fix=_FIX, minimum=1)
        if world is not None and world.value > 1:
            raise malformed(
                "WORLD_SIZE",
                environ["WORLD_SIZE"],
                "1 or unset, since no multi-process launcher was recognised "
                "(no torchrun, srun, MPI, SageMaker or Kubeflow variables)",
                _FIX,
            )
        rank = read_optional_int(environ, "RANK", fix=_FIX)
        if rank is not None and rank.value > 0:
            raise malformed(
                "RANK",
                environ["RANK"],
                "0 or unset, since no multi-process launcher was recognised",
                _FIX,
            )
        port = read_master_port(environ, default_port(), fix=_FIX)
        zero = Value(0, "rank 0")
        one = Value(1, "world size 1")
        return build_env(
            kind=self.name,
            rank=zero,
            local_rank=zero,
            world_size=one,
            local_world_size=one,
            node_rank=zero,
            num_nodes=one,
            master_addr=LOOPBACK,
            master_port=port,
            reasons=[
                "no torchrun, Slurm task, MPI, SageMaker or Kubeflow variables: one process",
                f"master {LOOPBACK}, {port.source}",
            ],
            fix=_FIX,
        )
