"""Where `scaletrain train` runs: as one rank of a launched job, or as its node's launcher.

- Started by torchrun, or by srun / mpirun with several tasks per node, each process
  is a rank already: it trains where it is.
- A task alone on its node (srun / mpirun with one task per node) is that node's
  launcher when there is more than one process to start there (`--nproc` > 1, or
  Slurm's SLURM_GPUS_ON_NODE > 1) or restarts to supervise (`--max-restarts`);
  otherwise it is a rank like any other, one per node.
- SageMaker and Kubeflow start one process per node to be its launcher; with the
  multi-node flags (`--nnodes`, `--rdzv-endpoint`) the user says the same by hand.
- In a Slurm batch script the same command runs again under srun, one task per node.

The run directory must be the same on every node, and must not be an earlier job's:
SageMaker's SM_MODEL_DIR (what the platform uploads), else runs/<recipe>-<job id>
where the scheduler names the job (the same id after a requeue, so a requeued job
resumes), else runs/<recipe>-<time> chosen here on one node, else by rank 0 (a
multi-node job without a job id: each node's clock would give its own name).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from scaletrain.env.network import node_range
from scaletrain.launch.plan import node_environment

if TYPE_CHECKING:
    from scaletrain.env.base import ClusterEnv
    from scaletrain.train.config import TrainConfig

__all__ = ["Placement", "default_out", "place"]


@dataclass(frozen=True, slots=True)
class Placement:
    """How this `scaletrain train` process takes part in the job."""

    mode: Literal["rank", "launcher", "srun"]
    """rank: train here as one rank of a job someone else launched; launcher: start
    this node's workers; srun: run the command again under srun (a batch script)."""
    nodes: int
    """Nodes in the job (the most, for an elastic range)."""
    env: ClusterEnv | None
    """The detected environment; None in a batch script, which has no rank."""
    procs_per_node_hint: int | None = None
    """Workers per node the platform asks for (its GPUs), if it says."""


def _user_topology(config: TrainConfig) -> bool:
    return (
        config.nnodes is not None
        or config.node_rank is not None
        or config.rdzv_endpoint is not None
    )


def place(config: TrainConfig, environ: Mapping[str, str] | None = None) -> Placement:
    """Decide, from the settings and the environment, where this process trains."""
    from scaletrain.env import detect
    from scaletrain.launch.batch import in_batch_script, job_nodes

    environ = os.environ if environ is None else environ
    if _user_topology(config):
        _, nodes = node_range(config.nnodes or "1")
        env = detect(environ) if config.env == "auto" and not in_batch_script(environ) else None
        if config.env != "auto":
            env = detect(environ, kind=config.env)
        hint = env.procs_per_node_hint if env is not None and env.per_node else None
        return Placement("launcher", nodes, env, hint)
    if config.env == "auto" and in_batch_script(environ):
        return Placement("srun", job_nodes(environ), None)
    env = detect(environ, kind=config.env)
    if env.per_node:
        nodes = env.num_nodes
        if env.rendezvous is not None:
            _, nodes = node_range(env.rendezvous.nnodes)
        return Placement("launcher", nodes, env, env.procs_per_node_hint)
    if env.kind == "local":
        return Placement("launcher", 1, env)
    if env.kind in ("slurm", "mpi") and env.local_world_size == 1:
        wanted = config.nproc or env.procs_per_node_hint or 1
        if wanted > 1 or config.max_restarts > 0:
            node_environment(env)  # the same rules as `scaletrain launch`
            return Placement("launcher", env.num_nodes, env, env.procs_per_node_hint)
    return Placement("rank", env.num_nodes, env)


def default_out(
    config: TrainConfig, placement: Placement, environ: Mapping[str, str]
) -> str | None:
    """The run directory when --out is not given; None: rank 0 chooses it (see above)."""
    from scaletrain.env import job_id
    from scaletrain.env.sagemaker import model_dir

    if config.out is not None:
        return config.out
    sagemaker = model_dir(environ)
    if sagemaker is not None:
        return sagemaker
    job = job_id(environ, placement.env)
    if job is not None:
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in job)
        return os.path.join("runs", f"{config.run_name()}-{safe}")
    if placement.mode == "launcher" and placement.nodes == 1:
        # One process decides for every worker of this node; ranks started by someone
        # else would each read their own clock.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return os.path.join("runs", f"{config.run_name()}-{stamp}")
    return None
