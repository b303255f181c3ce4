"""The step ledger as an observer of `scaletrain train`, and TensorBoard scalars.

The ledger measures through its hooks (the trainer's loop is a plain loop on rt.setup
and rt.loader); this observer tells it what hooks cannot see: the run directory and the
step a resumed run starts at, when evaluation ends, when the run ends (the whole-run
summary is gathered from every rank then, a collective every rank reaches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.observe.events import EvalEvent, Observer, RunInfo
from scaletrain.observe.ledger import StepLedger
from scaletrain.observe.phases import PHASES
from scaletrain.observe.stragglers import Straggler
from scaletrain.observe.window import WindowStats

__all__ = ["LedgerObserver", "TensorBoardScalars", "tensorboard_available"]


class LedgerObserver(Observer):
    """On every rank. `profile`: a window of steps ("10-15") to record with torch.profiler."""

    def __init__(self, ledger: StepLedger, *, profile: str | None = None) -> None:
        self.ledger = ledger
        self.profile = profile

    def on_run_start(self, info: RunInfo) -> None:
        ledger = self.ledger
        ledger.set_start_step(info.start_step)
        ledger.set_out(info.out)
        if self.profile is None:
            return
        from scaletrain.observe.profiling import arm_profile, parse_steps, window_past_end

        first, last = parse_steps(self.profile)
        if first > info.total_steps:
            raise window_past_end(self.profile, info.total_steps)
        if info.start_step >= first:
            ledger.say(
                f"scaletrain: the profile window {first}-{last} is behind this resumed run "
                f"(it starts at step {info.start_step}): not recorded again."
            )
            return
        arm_profile(ledger, (first, last), info.out, rank=info.rank, world_size=info.world_size)

    def on_eval(self, event: EvalEvent) -> None:
        self.ledger.end_eval()

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        self.ledger.finish(collective=True)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self.ledger.finish(collective=True)

    def close(self) -> None:
        # A failed run: no collective (a peer may be gone); the files are closed.
        self.ledger.close()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardScalars(Observer):
    """Rank 0: loss, lr, samples/s, evaluation and the ledger's phase medians per window,
    as TensorBoard scalars in `logdir` (written only where `tensorboard` is installed)."""

    reports = "the TensorBoard scalars"

    def __init__(self, logdir: Path, ledger: StepLedger | None = None) -> None:
        self.logdir = logdir
        self._writer: Any = None
        self._failed = False
        if ledger is not None:
            ledger.listeners.append(self._window)

    def on_run_start(self, info: RunInfo) -> None:
        # Opened once the start is accepted, not at construction: a start that is
        # refused (a resume whose settings change the run's meaning, no valid
        # checkpoint) must leave the run directory exactly as it found it, and
        # SummaryWriter creates an events file the moment it is constructed. Nor at the
        # first scalar: that is the ledger's first window, inside a step, and importing
        # TensorBoard there (a quarter of a second) read as the step's synchronisation.
        self.writer  # noqa: B018

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.logdir))
        return self._writer

    def on_log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        self.writer.add_scalar("train/loss", float(record["loss"]), step)
        self.writer.add_scalar("train/lr", float(record["lr"]), step)
        self.writer.add_scalar("train/samples_per_s", float(record["samples_per_s"]), step)

    def on_eval(self, event: EvalEvent) -> None:
        self.writer.add_scalar("eval/loss", event.loss, event.step)
        self.writer.add_scalar(f"eval/{event.metric.replace(' ', '_')}", event.accuracy, event.step)

    def _window(self, stats: WindowStats, newly: list[Straggler]) -> None:
        # Called by the ledger, outside the observers' guard: a failure here is said
        # once and turns these scalars off; it never reaches the ledger.
        if self._failed:
            return
        try:
            self._window_scalars(stats)
        except Exception as exc:
            from scaletrain.observe.output import tell

            self._failed = True
            tell(
                f"scaletrain: {self.reports} failed ({type(exc).__name__}: {exc}) and are off "
                "for the rest of the run; training goes on."
            )

    def _window_scalars(self, stats: WindowStats) -> None:
        step = stats.last_step
        for name in (*PHASES, "step"):
            s = stats.spreads[name]
            if s.median == s.median:  # not NaN
                self.writer.add_scalar(f"ledger/{name}_ms_median", s.median * 1e3, step)
                self.writer.add_scalar(f"ledger/{name}_ms_max", s.max * 1e3, step)

    def close(self) -> None:
        self._failed = True  # no window opens a new events file after this
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
