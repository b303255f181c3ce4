"""What every job file says: which training to run, on how many nodes, with how many
processes each. The writers (sbatch.py, pytorchjob.py, sagemaker.py) turn it into one
scheduler's format; each is the inverse of that scheduler's reader in scaletrain.env.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from scaletrain.env.network import node_range
from scaletrain.errors import ConfigError
from scaletrain.settings import field_specs
from scaletrain.train.config import TrainConfig

__all__ = ["NODE_FIELDS", "JobSpec", "job_spec", "train_arguments"]

NODE_FIELDS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "local_addr", "env")
"""Settings that place a process in a job: the job file says them in the scheduler's own
terms, so they are not passed on to the training command."""

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
"""What every scheduler takes as a job name (each writer checks its own rule too: a
Kubernetes name is lowercase, a SageMaker one has no '_' or '.')."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A training job, independent of the scheduler."""

    name: str
    """Job name: letters, digits, '-', '_', '.' (each writer checks its platform's rule)."""
    min_nodes: int
    max_nodes: int
    """Nodes; min < max for an elastic job (only platforms with elastic jobs accept it)."""
    nproc: int
    """Training processes per node (one per GPU; on CPU nodes what --nproc says, else 1)."""
    gpus_per_node: int
    """GPUs to request per node (0: a CPU job)."""
    train_args: tuple[str, ...]
    """`scaletrain train` flags, without the node flags (see NODE_FIELDS) and without
    --nproc: each scheduler says the processes per node in its own terms."""
    config: TrainConfig
    """The settings those flags describe."""

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def world_size(self) -> int:
        return self.max_nodes * self.nproc


def train_arguments(config: TrainConfig, skip: Sequence[str] = NODE_FIELDS) -> list[str]:
    """`scaletrain train` flags that reproduce `config`: every setting that differs from its
    default, so the job needs no config file on the cluster."""
    default = TrainConfig()
    args: list[str] = []
    for spec in field_specs(TrainConfig):
        if spec.name in skip:
            continue
        value = getattr(config, spec.name)
        if value == getattr(default, spec.name):
            continue
        if isinstance(value, bool):
            args.append(spec.flag if value else "--no-" + spec.flag[2:])
        elif value is not None:
            args += [spec.flag, str(value)]
    return args


def job_spec(config: TrainConfig, *, nnodes: str, name: str | None, gpus_per_node: int) -> JobSpec:
    """The JobSpec for `config` on `nnodes` nodes ("N" or "MIN:MAX")."""
    try:
        lo, hi = node_range(nnodes)
    except ValueError as exc:
        raise ConfigError(
            f"--nnodes {nnodes!r}: {exc}. Expected a node count such as 2, or MIN:MAX such as "
            "1:4 for an elastic job. Fix: pass e.g. --nnodes 2."
        ) from None
    if gpus_per_node < 0:
        raise ConfigError(
            f"--gpus-per-node {gpus_per_node}: expected a number of GPUs >= 0 (0: a CPU job). "
            "Fix: pass e.g. --gpus-per-node 4."
        )
    if config.nproc is not None:
        nproc = config.nproc
    elif gpus_per_node > 0:
        nproc = gpus_per_node
    else:
        # A CPU node: one process using all its cores, as SageMaker's toolkit runs and
        # as HPC sites expect; --nproc asks for more.
        nproc = 1
    if gpus_per_node > 0 and nproc > gpus_per_node:
        raise ConfigError(
            f"--nproc {nproc} asks for more processes per node than --gpus-per-node "
            f"{gpus_per_node}: each process drives one GPU. Fix: --nproc {gpus_per_node}, or "
            f"leave --nproc out (one per GPU)."
        )
    job_name = name if name is not None else f"scaletrain-{config.run_name()}"
    if not _NAME.fullmatch(job_name):
        raise ConfigError(
            f"--name {job_name!r} is not a usable job name. Expected letters, digits, '-', "
            "'_' and '.', starting and ending with a letter or digit. Fix: pass e.g. --name "
            "mnist-ddp."
        )
    fixed = dataclasses.replace(config, nproc=nproc)
    return JobSpec(
        name=job_name,
        min_nodes=lo,
        max_nodes=hi,
        nproc=nproc,
        gpus_per_node=gpus_per_node,
        train_args=tuple(train_arguments(fixed, skip=(*NODE_FIELDS, "nproc"))),
        config=fixed,
    )
