"""An sbatch script for a training job: the inverse of scaletrain.env.slurm.

The script asks for the nodes (`--nodes=N`, or `MIN-MAX`: Slurm starts the job on
as many as it can give, and every task then reads the size it got), one task per
training process (`--ntasks-per-node`), the GPUs and CPUs, and runs `srun scaletrain
train ...`: srun starts every rank and tells it its place (SLURM_PROCID, SLURM_NODEID,
SLURM_STEP_NODELIST, ...), which the Slurm reader turns back into ranks. With
`--max-restarts K` it runs one launcher task per node instead (torch's agent
restarts the workers), since restarts need someone to do them.

Preemption, as Lightning's SLURM auto-requeue does it: `--signal=USR1@90` has Slurm
signal every task 90 s before the time limit (so does `scancel --signal=USR1`); each
rank finishes its step, saves, and exits 75 (EXIT_PREEMPTED). srun returns the
highest exit code of its tasks, and on 75 the script runs `scontrol requeue`, which
`--requeue` permits. The requeued job keeps its SLURM_JOB_ID, so the default run
directory, runs/<recipe>-<job id>, is the same and the job resumes from its newest
checkpoint.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from scaletrain import __version__
from scaletrain.errors import ConfigError
from scaletrain.exitcodes import EXIT_PREEMPTED
from scaletrain.launch.jobs.spec import JobSpec

__all__ = ["SbatchOptions", "write_sbatch"]

_TIME = re.compile(r"(?:\d+-)?\d+(?::\d{1,2}){0,2}")


@dataclass(frozen=True, slots=True)
class SbatchOptions:
    """What only an sbatch script says."""

    time: str | None = None
    """Time limit in Slurm's format (minutes, HH:MM:SS, D-HH:MM:SS); None: the partition's."""
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    """CPUs for each training process; None: Slurm's default."""
    signal_s: int = 90
    """Seconds before the time limit at which the ranks are told to save and stop."""
    python: str = "python"
    """The interpreter that runs scaletrain on the compute nodes."""
    setup: Sequence[str] = field(default_factory=tuple)
    """Shell lines run before srun (module load ..., source venv/bin/activate)."""
    output: str = "%x-%j.out"
    """The job's log file, in sbatch's pattern language (%x name, %j job id)."""

    def __post_init__(self) -> None:
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise ConfigError(
                f"--time {self.time!r} is not a Slurm time limit. Expected minutes, HH:MM:SS "
                "or D-HH:MM:SS. Fix: pass e.g. --time 4:00:00."
            )
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(
                f"--cpus-per-task {self.cpus_per_task}: expected at least 1. Fix: pass e.g. "
                "--cpus-per-task 8, or leave it out."
            )
        if self.signal_s < 10:
            raise ConfigError(
                f"--signal-seconds {self.signal_s}: too little time to save before the limit. "
                "Expected 10 or more. Fix: pass e.g. --signal-seconds 90."
            )


def write_sbatch(spec: JobSpec, opts: SbatchOptions) -> str:
    """The sbatch script's text."""
    launchers = spec.config.max_restarts > 0
    nodes = str(spec.max_nodes) if not spec.elastic else f"{spec.min_nodes}-{spec.max_nodes}"
    tasks = 1 if launchers else spec.nproc
    cpus = opts.cpus_per_task * (spec.nproc if launchers else 1) if opts.cpus_per_task else None
    shape = (
        f"{nodes} node(s) x {spec.nproc} process(es), one launcher task per node "
        f"(--max-restarts {spec.config.max_restarts})"
        if launchers
        else f"{nodes} node(s) x {spec.nproc} task(s), one per training process"
    )
    directives = [
        f"--job-name={spec.name}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks}",
    ]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    if cpus:
        directives.append(f"--cpus-per-task={cpus}")
    if opts.time:
        directives.append(f"--time={opts.time}")
    if opts.partition:
        directives.append(f"--partition={opts.partition}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    directives += [
        f"--signal=USR1@{opts.signal_s}",
        "--requeue",
        "--open-mode=append",
        f"--output={opts.output}",
    ]
    # srun gives each rank its place; a launcher task per node must be told how many
    # workers to start (Slurm says it only for GPUs, as SLURM_GPUS_ON_NODE).
    nproc = ["--nproc", str(spec.nproc)] if launchers else []
    train = [opts.python, "-m", "scaletrain", "train", *spec.train_args, *nproc]
    # No --kill-on-bad-exit: with it, the first rank to exit 75 after the agreed save
    # gets the others killed while they exit, and the script sees 143, not 75. The
    # ranks end together without it: a failed rank's peers fail on the closed
    # connection, rank 0 stops waiting for ranks that never joined when its store's
    # join timeout ends, and the watchdog ends a hang (exit 86).
    srun = ["srun", *(["--whole"] if launchers else []), *train]
    lines = [
        "#!/bin/bash",
        f"# Written by `scaletrain job sbatch` (scaletrain {__version__}): {shape}.",
        "# Submit with `sbatch THIS_FILE`. Ranks save and exit "
        f"{EXIT_PREEMPTED} when Slurm signals USR1",
        f"# ({opts.signal_s} s before the time limit, or `scancel --signal=USR1 JOBID`); this "
        "script then requeues",
        "# the job, which resumes from its newest checkpoint in runs/<recipe>-<job id>.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        *opts.setup,
        shlex.join(srun),
        "code=$?",
        f'if [ "$code" -eq {EXIT_PREEMPTED} ]; then',
        '    echo "scaletrain: preempted and saved (exit '
        f'{EXIT_PREEMPTED}): requeueing job $SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"
