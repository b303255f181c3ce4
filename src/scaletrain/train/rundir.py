"""What a run directory already holds, and what a new start may do with it.

A run directory (`--out`) is one run: its checkpoints, metrics.jsonl, config.json and,
once it finished, model.pt. Starting again on it resumes from its checkpoints; what
else it may hold decides the rest:

* finished (model.pt) with no checkpoint to continue from: refused, since training
  again would replace its model.pt and add a second summary to its metrics, unless
  `--overwrite`, which removes the run's files first;
* interrupted with no checkpoint (a crash or Ctrl-C before the first save): started
  over, its metrics.jsonl kept aside as metrics.interrupted-N.jsonl (its ledger,
  traces and report as observe.interrupted-N/ and so on), and said so.

This module imports no torch: the CLI checks a directory before it launches anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import ConfigError, spell
from scaletrain.observe.report.trackers import MLFLOW_RUN_FILE

__all__ = [
    "PIDS_DIR",
    "RunDir",
    "clear_run",
    "inspect_run",
    "refuse_reuse",
    "remove_pid_files",
    "set_aside_interrupted",
]

PREEMPTED_MARKER = "PREEMPTED"
"""File rank 0 writes into the run directory when a signal stopped the run."""

PIDS_DIR = "pids"
"""RUN/pids/rank<r>.pid: each worker's pid while it runs (removed as it exits)."""

_TRAINED = ("checkpoints", "model.pt", "metrics.jsonl", "config.json", PREEMPTED_MARKER, PIDS_DIR)
"""What a run writes as it trains and saves."""
_WATCHED = (
    "observe",
    "tensorboard",
    "mlruns",
    MLFLOW_RUN_FILE,
    "traces",
    "report.html",
    "hang",
    "flight_recorder",
)
"""What a run writes about itself: the step ledger (observe/), TensorBoard scalars, the
MLflow store and the id of the MLflow run it logs to, profiler traces, the report drawn
from them, and a hang's diagnosis. Each describes one run; a new run in the same
directory would add to them (or log to the old MLflow run), and a report or `plan
--check` would then draw two runs as one."""
_RUN_FILES = _TRAINED + _WATCHED


@dataclass(frozen=True, slots=True)
class RunDir:
    """What is in a run directory, by name only (nothing is read or verified here)."""

    path: Path
    finished: bool
    """model.pt is there: the run ended (written last, by the run's end)."""
    checkpoints: int
    """Checkpoints whose save finished (a manifest.json; valid or not)."""
    metrics: bool
    """metrics.jsonl is there: the run trained (or began to)."""

    @property
    def holds_run(self) -> bool:
        return self.finished or self.checkpoints > 0 or self.metrics

    def what(self) -> str:
        """The run's files, as a person would list them."""
        parts = []
        if self.finished:
            parts.append("model.pt")
        if self.metrics:
            parts.append("metrics.jsonl")
        if self.checkpoints:
            parts.append(f"{self.checkpoints} checkpoint(s)")
        return ", ".join(parts) or "nothing"


def inspect_run(path: str | Path) -> RunDir:
    path = Path(path)
    folder = path / "checkpoints"
    checkpoints = (
        sum(1 for d in folder.iterdir() if d.is_dir() and (d / "manifest.json").is_file())
        if folder.is_dir()
        else 0
    )
    return RunDir(
        path=path,
        finished=(path / "model.pt").is_file(),
        checkpoints=checkpoints,
        metrics=(path / "metrics.jsonl").is_file(),
    )


def _refuse_unusable(path: Path, field: str) -> None:
    """A run directory is (or will be made) a directory this user can write: a file at
    its path or above it, or a parent it cannot write, is refused before anything runs
    (rank 0's mkdir would otherwise fail after every process started)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    fix = f"Fix: pass a directory, new or a run's, e.g. {spell(field, 'runs/NAME')}"
    if not existing.is_dir():
        where = "names a file" if existing == path else f"is inside {existing}, which is a file"
        raise ConfigError(
            f"{spell(field, str(path))} {where}; expected a directory, where a run keeps its "
            f"checkpoints, metrics.jsonl and model.pt. {fix}.",
            field=field,
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "that directory" if existing == path else f"{existing}, where it would be made,"
        raise ConfigError(
            f"{spell(field, str(path))}: {what} is not writable by this user; expected a "
            f"directory the run can write its checkpoints and metrics into. {fix}.",
            field=field,
        )


def refuse_reuse(run: RunDir, *, overwrite: bool, field: str = "out") -> None:
    """Raise ConfigError when `run` cannot be a run directory (a file, not writable), or
    when starting on it would replace a finished run's results.

    `field` is the setting that named the directory: "out" for a run, "fork" for the
    directory a fork would start in (which must not hold a run at all).
    """
    _refuse_unusable(run.path, field)
    if overwrite:
        return
    if field == "fork" and run.holds_run:
        raise ConfigError(
            f"{spell('fork', str(run.path))}: that directory already holds a run "
            f"({run.what()}); a fork starts a new run and never writes into another. Fix: "
            f"name a new directory, or add {spell('overwrite', True)} to replace that run.",
            field="fork",
        )
    if field == "out" and run.finished and run.checkpoints == 0:
        raise ConfigError(
            f"{spell('out', str(run.path))} holds a finished run ({run.what()}) and no "
            "checkpoint to continue from: training again would replace its model.pt and add "
            f"a second summary to its metrics. Fix: pass a new {spell('out')}, start a new "
            f"run from its weights with {spell('fork', 'NEW_RUN')}, or add "
            f"{spell('overwrite', True)} to replace that run.",
            field="out",
        )


def clear_run(path: Path) -> list[str]:
    """Remove a run's own files (for --overwrite); anything else in the directory stays."""
    removed = []
    for name in _RUN_FILES:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            continue
        removed.append(name)
    for old in sorted(path.glob("*.interrupted-*")):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
        removed.append(old.name)
    return removed


def set_aside_interrupted(run: RunDir) -> str | None:
    """A run that began and left no checkpoint: keep its metrics aside, say what was found.

    Returns the sentence for the run's header, or None when there was nothing to find.
    """
    if run.finished or run.checkpoints or not run.metrics:
        return None
    metrics = run.path / "metrics.jsonl"
    if metrics.stat().st_size == 0:
        metrics.unlink()  # opened by a start that failed before its first step
        return None
    n = 1
    while (run.path / f"metrics.interrupted-{n}.jsonl").exists():
        n += 1
    kept = run.path / f"metrics.interrupted-{n}.jsonl"
    (run.path / "metrics.jsonl").rename(kept)
    (run.path / "config.json").unlink(missing_ok=True)
    names = [kept.name]
    # What it wrote about itself goes aside with its metrics: the new run's own start
    # clean (a ledger appends to the files it finds).
    for name in _WATCHED:
        source = run.path / name
        if source.exists():
            stem, dot, ext = name.partition(".")
            target = run.path / f"{stem}.interrupted-{n}{dot}{ext}"
            source.rename(target)
            names.append(target.name)
    return (
        f"{run.path} held a run that was interrupted before its first checkpoint: starting "
        f"over from step 0 (what it wrote is kept in {', '.join(names)})"
    )


def remove_pid_files(run_dir: str | Path, pids: Collection[int]) -> None:
    """Remove the pid files of the workers `pids` (all gone: killed at once, they could
    not remove their own), and RUN/pids/ once empty. Other files stay: on a disk shared
    by several nodes, another node's workers may still be running."""
    folder = Path(run_dir) / PIDS_DIR
    for path in folder.glob("rank*.pid"):
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            continue
        if pid in pids:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
