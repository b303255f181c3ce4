"""Workers started by torchrun (torch.distributed.elastic).

torchrun's agent writes every worker's place into its environment
(torch/distributed/elastic/agent/server/local_elastic_agent.py). It is the
innermost launcher wherever it runs (under srun, mpirun or in a Kubeflow pod),
so it is tried first: its variables describe this process, the outer
scheduler's describe the agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from scaletrain.env._common import (
    LOOPBACK,
    Value,
    build_env,
    default_port,
    missing,
    read_int,
    read_master_addr,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment

__all__ = ["TORCHELASTIC_MARKERS", "TorchElasticEnvironment", "is_torchelastic"]

TORCHELASTIC_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
"""Variables that torchrun sets and a one-process-per-pod scheduler (Kubeflow) does not."""

_WHY = "torchrun sets it for every worker it starts"
_FIX = (
    "these variables are written by torchrun for each worker; launch with "
    "`torchrun --nproc-per-node=<N> train.py` (or `scaletrain launch`) and do not "
    "export RANK, LOCAL_RANK or WORLD_SIZE yourself"
)


def is_torchelastic(environ: Mapping[str, str]) -> bool:
    """True for a torchrun worker, or a launcher that mimics one (torch.distributed.launch).

    RANK and WORLD_SIZE alone are not enough: Kubeflow sets them too, per pod.
    """
    if "TORCHELASTIC_RUN_ID" in environ:
        return True
    has_local = "GROUP_RANK" in environ or "LOCAL_RANK" in environ
    return has_local and "RANK" in environ and "WORLD_SIZE" in environ


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun / torchelastic: one process per device, all placement given by the agent."""

    name: ClassVar[str] = "torchelastic"
    priority: ClassVar[int] = 0

    def _detect(self, environ: Mapping[str, str]) -> bool:
        return is_torchelastic(environ)

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        reasons: list[str] = []
        run_id = environ.get("TORCHELASTIC_RUN_ID")
        if run_id is not None:
            reasons.append(f"TORCHELASTIC_RUN_ID={run_id!r}: a worker started by torchrun")
        else:
            reasons.append(
                "LOCAL_RANK/GROUP_RANK with RANK and WORLD_SIZE, no TORCHELASTIC_RUN_ID: "
                "a torchrun-style launcher"
            )

        rank = read_int(environ, "RANK", why=_WHY, fix=_FIX)
        world_size = read_int(environ, "WORLD_SIZE", why=_WHY, fix=_FIX, minimum=1)
        local_rank = read_int(environ, "LOCAL_RANK", why=_WHY, fix=_FIX)
        group_rank = read_optional_int(environ, "GROUP_RANK", fix=_FIX)
        # GROUP_WORLD_SIZE counts agents, i.e. nodes. ROLE_WORLD_SIZE is NOT a
        # node count: it counts the workers sharing this role (== WORLD_SIZE
        # with the single default role), so it is deliberately not read here.
        group_world = read_optional_int(environ, "GROUP_WORLD_SIZE", fix=_FIX, minimum=1)

        local_world = read_optional_int(environ, "LOCAL_WORLD_SIZE", fix=_FIX, minimum=1)
        if local_world is None:
            # Pre-1.9 torch.distributed.launch did not export it; with the node
            # count we can still recover it where every node runs as many workers.
            if group_world is None or world_size.value % group_world.value:
                raise missing(
                    "LOCAL_WORLD_SIZE",
                    f"{world_size.source} and no GROUP_WORLD_SIZE to derive it from; {_WHY}",
                    _FIX,
                )
            local_world = Value(
                world_size.value // group_world.value,
                f"LOCAL_WORLD_SIZE={world_size.value // group_world.value} "
                "(derived: WORLD_SIZE // GROUP_WORLD_SIZE)",
            )
        reasons.append(
            f"{rank.source}, {local_rank.source}, {world_size.source}, {local_world.source}"
        )

        if group_world is not None:
            num_nodes = group_world
        else:
            # Round up: an uneven last node still counts as a node.
            n = -(-world_size.value // local_world.value)
            num_nodes = Value(n, f"{n} nodes (derived: WORLD_SIZE / LOCAL_WORLD_SIZE)")
        if group_rank is not None:
            node_rank = group_rank
        else:
            n = rank.value // local_world.value
            node_rank = Value(n, f"node rank {n} (derived: RANK // LOCAL_WORLD_SIZE)")
        reasons.append(f"{node_rank.source}, {num_nodes.source}")

        restarts = environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
        if restarts not in ("", "0"):
            reasons.append(f"TORCHELASTIC_RESTART_COUNT={restarts}: restarted by the elastic agent")

        port = read_master_port(environ, default_port(), fix=_FIX)
        addr = read_master_addr(environ)
        if addr is not None:
            reasons.append(f"MASTER_ADDR={addr}, {port.source}")
        elif num_nodes.value > 1:
            raise missing(
                "MASTER_ADDR",
                f"the job spans {num_nodes.value} nodes and the host of rank 0 must be known",
                _FIX,
            )
        else:
            # torchrun always exports MASTER_ADDR; only a hand-rolled launcher
            # forgets it, and on one node loopback is the only right answer.
            addr = LOOPBACK
            reasons.append(f"MASTER_ADDR unset on a single node: using {LOOPBACK}, {port.source}")

        return build_env(
            kind=self.name,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            reasons=reasons,
            fix=_FIX,
        )
