"""`scaletrain launch` (or `train`) typed in a Slurm batch script: the same command under srun.

The batch script is one process on the allocation's first node that Slurm has not
placed anywhere (SLURM_JOB_ID without a task's step id). Building a process group
there hangs, and running alone there uses one node of what may be many. What the
user means is one launcher per node of the allocation, which is exactly

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --whole <command>

- `--whole` gives the single task every CPU, GPU and byte of memory the job has on
  its node (since Slurm 20.11 a step gets only what it asks for: one CPU per task
  by default, so the launcher's workers would share one core);
- no `--kill-on-bad-exit`: when the workers stop on a preemption signal, each
  launcher exits 75 after the save, and the first one to exit would get the others
  killed mid-exit (srun then returns 143, and the batch script cannot tell a
  preemption). The launchers end together without it: a node whose launcher fails
  closes its workers' connections, and the other nodes' workers fail on them;
- srun forwards the signals Slurm sends the batch step (`scancel --signal`,
  `#SBATCH --signal=USR1@90` without `B:` reaches the step's tasks directly) and
  returns the highest exit code of the tasks, so 75 (preempted, saved) reaches the
  script's requeue logic.

Inside the step each task reads as a Slurm task alone on its node, which
scaletrain.launch.plan turns into a static rendezvous. `--env local` (`env="local"`
in the API) runs the command here instead, as one node on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scaletrain.errors import ConfigError

__all__ = ["in_batch_script", "job_nodes", "srun_command"]

_MPI_MARKERS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MPI_LOCALRANKID")
_NODES_VARS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")


def in_batch_script(environ: Mapping[str, str]) -> bool:
    """True in a Slurm batch script or salloc shell, outside any srun task or MPI rank."""
    from scaletrain.env.slurm import is_batch_script

    return is_batch_script(environ) and not any(m in environ for m in _MPI_MARKERS)


def job_nodes(environ: Mapping[str, str]) -> int:
    """The batch script's node count (SLURM_JOB_NUM_NODES); ConfigError where Slurm set none."""
    for name in _NODES_VARS:
        raw = environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    raise ConfigError(
        "This is a Slurm batch script (SLURM_JOB_ID is set, no task step), but neither "
        "SLURM_JOB_NUM_NODES nor SLURM_NNODES says how many nodes the job has. Expected "
        "Slurm to set them in every batch script. Fix: run the command with srun yourself, "
        "`srun --ntasks-per-node=1 scaletrain launch ...`."
    )


def srun_command(nodes: int, command: Sequence[str]) -> list[str]:
    """srun with one task per node of the allocation, running `command`."""
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--whole",
        *command,
    ]
