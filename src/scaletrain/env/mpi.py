"""Processes started by mpirun / mpiexec: Open MPI, or MPICH and Intel MPI (Hydra).

MPI gives every process its rank and its node-local rank but never says
where rank 0 runs, so a multi-node job needs MASTER_ADDR passed explicitly.

The rendezvous port: torch's default 29500 is what two jobs on one host would
both take (the second one's rank 0 fails to bind it, and its other ranks may
join the first job's store). Open MPI names each mpirun's job (Open MPI 4.x:
OMPI_MCA_ess_base_jobid, a number; Open MPI 5 / PRRTE: PMIX_NAMESPACE), so the
port is derived from that id as Slurm's is. Hydra (MPICH, Intel MPI) exports no
job id; there MASTER_PORT is the way to run two jobs on one host, and rank 0
checks that its port is free before it starts (scaletrain.dist).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from scaletrain.env._common import (
    LOOPBACK,
    Value,
    build_env,
    default_port,
    port_from_job_id,
    read_int,
    read_master_addr,
    read_master_port,
    read_optional_int,
)
from scaletrain.env.base import ClusterEnv, ClusterEnvironment
from scaletrain.errors import EnvironmentDetectionError

__all__ = ["MPIEnvironment", "mpirun_command", "tty_from_launcher"]


@dataclass(kw_only=True, frozen=True, slots=True)
class _Flavour:
    """The variable names one MPI family uses."""

    label: str
    """How the user knows the launcher."""
    rank: str
    """Global rank."""
    size: str
    """Number of processes."""
    local_rank: str
    """Rank among the processes on this node."""
    local_size: str
    """Number of processes on this node."""
    export: str
    """How this launcher forwards a variable to every process ({mpirun}: `mpirun_command()`)."""


_OPENMPI = _Flavour(
    label="Open MPI's mpirun",
    rank="OMPI_COMM_WORLD_RANK",
    size="OMPI_COMM_WORLD_SIZE",
    local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
    local_size="OMPI_COMM_WORLD_LOCAL_SIZE",
    export="{mpirun} -x MASTER_ADDR=<host of rank 0>",
)
_HYDRA = _Flavour(
    label="MPICH / Intel MPI's mpiexec (Hydra)",
    rank="PMI_RANK",
    size="PMI_SIZE",
    local_rank="MPI_LOCALRANKID",
    local_size="MPI_LOCALNRANKS",
    export="mpiexec -genv MASTER_ADDR <host of rank 0> (Open MPI: {mpirun} -x MASTER_ADDR=<host of rank 0>)",
)


def mpirun_command() -> str:
    """Open MPI's mpirun as this user must type it: as root (a container's usual user)
    it refuses to start without --allow-run-as-root."""
    return "mpirun --allow-run-as-root" if os.geteuid() == 0 else "mpirun"


def _fix(flavour: _Flavour) -> str:
    starter = mpirun_command() if flavour is _OPENMPI else "mpiexec"
    return (
        f"these variables are written by {flavour.label} for each process; start the "
        f"program with it (e.g. `{starter} -np <N> python train.py`) and do not set them "
        "by hand"
    )


def tty_from_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True in a process Open MPI's mpirun started: its stdout is a terminal whatever
    the user's output is, so a terminal there says nothing about where the text lands.

    mpirun gives every rank a pseudo-terminal for stdout and copies what comes out of
    it to its own stdout: a log file or a pipe as often as a terminal. (MPICH's Hydra
    gives its ranks pipes, which tell the truth.)
    """
    environ = os.environ if environ is None else environ
    return _OPENMPI.rank in environ


# Open MPI 4.x, then Open MPI 5 (PRRTE): the mpirun job's id, the same in every rank.
_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


def _job_id(environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in _JOB_ID_VARS:
        value = environ.get(name, "").strip()
        if value:
            return value, name
    return None


def _node_rank(rank: int, local_rank: int, local_size: int, num_nodes: int) -> tuple[int, str]:
    """Which node this process is on, from the mapping the ranks reveal.

    OMPI_COMM_WORLD_NODE_RANK is not a node index (Open MPI documents it as the
    process's rank on its node across all jobs), and MPICH exports none, so the
    index is inferred: consecutive ranks per node (mpirun's default, by slot) or
    round-robin over nodes (--map-by node).
    """
    if rank % local_size == local_rank:
        return rank // local_size, f"node rank {rank // local_size} (ranks packed by node)"
    if rank // num_nodes == local_rank:
        return rank % num_nodes, f"node rank {rank % num_nodes} (ranks round-robin over nodes)"
    guess = min(rank // local_size, num_nodes - 1)
    return guess, f"node rank {guess} (mapping not recognised; a guess, used for logs only)"


class MPIEnvironment(ClusterEnvironment):
    """One process per rank, placed by the MPI launcher."""

    name: ClassVar[str] = "mpi"
    priority: ClassVar[int] = 20

    def _detect(self, environ: Mapping[str, str]) -> bool:
        return _OPENMPI.rank in environ or _HYDRA.rank in environ

    def _read(self, environ: Mapping[str, str]) -> ClusterEnv:
        flavour = _OPENMPI if _OPENMPI.rank in environ else _HYDRA
        fix = _fix(flavour)
        why = f"{flavour.label} sets it for every process"
        rank = read_int(environ, flavour.rank, why=why, fix=fix)
        world_size = read_int(environ, flavour.size, why=why, fix=fix, minimum=1)
        local_rank = read_int(environ, flavour.local_rank, why=why, fix=fix)
        local_world = read_int(environ, flavour.local_size, why=why, fix=fix, minimum=1)
        reasons = [
            f"{rank.source}, {world_size.source}: a process started by {flavour.label}",
            f"{local_rank.source}, {local_world.source}",
        ]

        # Open MPI 4 exports the node count; otherwise every node is assumed to hold
        # as many ranks as this one, which is exact for the usual uniform layout.
        counted = read_optional_int(environ, "OMPI_MCA_orte_num_nodes", fix=fix, minimum=1)
        if counted is not None and counted.value <= world_size.value:
            num_nodes = counted
        else:
            nodes = -(-world_size.value // local_world.value)
            num_nodes = Value(nodes, f"{nodes} nodes (derived: size / local size)")
        nodes = num_nodes.value
        index, how = _node_rank(rank.value, local_rank.value, local_world.value, nodes)
        node_rank = Value(index, how)
        reasons.append(f"{node_rank.source}, {num_nodes.source}")

        job = _job_id(environ)
        if job is None:
            default = default_port()
        else:
            derived = port_from_job_id(job[0])
            default = Value(derived, f"port {derived} derived from {job[1]}={job[0]}")
        port = read_master_port(environ, default, fix=fix)
        addr = read_master_addr(environ)
        if addr is not None:
            reasons.append(f"MASTER_ADDR={addr}, {port.source}")
        elif local_world.value == world_size.value:
            addr = LOOPBACK
            reasons.append(f"all {world_size.value} ranks on this node: {LOOPBACK}, {port.source}")
        else:
            raise EnvironmentDetectionError(
                f"MASTER_ADDR is not set and the job spans several nodes "
                f"({world_size.source}, {local_world.source}): MPI does not tell where "
                "rank 0 runs, so the rendezvous host is unknown. Expected MASTER_ADDR=<host "
                f"of rank 0> in every process. Fix: pass it through the launcher, "
                f"`{flavour.export.format(mpirun=mpirun_command())}` (usually the first host of "
                "your host file)."
            )

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
            fix=fix,
            job_id=None if job is None else job[0],
        )
