"""What rank 0 shows while training: a live bar in a terminal, plain lines in a log."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from scaletrain.env.mpi import tty_from_launcher

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["StepProgress"]


def _terminal(environ: Mapping[str, str]) -> bool | None:
    """Whether the console is a terminal: None lets rich decide (the output's isatty(),
    FORCE_COLOR, TTY_COMPATIBLE). Under Open MPI stdout is mpirun's pseudo-terminal,
    whatever the user's output is: no live bar and no colours there unless forced."""
    forced = bool(environ.get("FORCE_COLOR")) or environ.get("TTY_COMPATIBLE") == "1"
    return False if tty_from_launcher(environ) and not forced else None


class StepProgress:
    """One bar per epoch with live loss and samples/s; silent when `enabled` is False."""

    def __init__(self, *, enabled: bool, console: Console | None = None) -> None:
        # rich is imported here, not with the module: only rank 0 shows progress, and
        # importing rich would add to every other rank's start.
        from rich.console import Console

        from scaletrain.observe.output import LossyStream

        self.enabled = enabled
        # soft_wrap: in a log file a long line stays one line instead of wrapping at 80.
        # A closed stdout (`| head`) loses the progress, never the run (LossyStream).
        stream = LossyStream(
            sys.stdout,
            then="Training goes on; the run directory's metrics.jsonl keeps every record.",
        )
        self.console = console or Console(
            file=stream,  # type: ignore[arg-type]
            soft_wrap=True,
            force_terminal=_terminal(os.environ),
        )
        # In a log file (CI, `tee`) a live bar is noise: print a line per update instead.
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._label = ""

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end_epoch()

    def start_epoch(self, label: str, total: int, done: int = 0) -> None:
        """A fresh bar per epoch, so each finished epoch's bar stays above its results."""
        self.end_epoch()
        self._label = label
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} samples/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                label, total=total, completed=done, loss="-", speed="-"
            )
            self._progress.start()

    def end_epoch(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._task = None

    def update(self, step_in_epoch: int, total: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=step_in_epoch,
                loss=f"{loss:.4f}",
                speed=f"{samples_per_s:,.0f}",
            )
        else:
            self.console.print(
                f"{self._label} step {step_in_epoch}/{total}  loss {loss:.4f}  "
                f"{samples_per_s:,.0f} samples/s",
                highlight=False,
            )

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)
