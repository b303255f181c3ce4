"""What a training loop tells the things that watch it: run, step, evaluation, save, stop.

The loop (scaletrain.train) stays small and emits these events; everything that hears
them is a `LoopObserver`, the one interface for them, and an `EventBus` hands each event
to every observer on it. Each room of observe has its observer:

- hang: `WatchdogObserver` (hang/watchdog.py): every step is a heartbeat;
- metrics: `LedgerObserver` (metrics/ledger_observer.py): the run directory, the
  evaluation's end and the run's end, which the ledger's hooks cannot see;
- report: `TrackerObserver` (report/trackers.py): scalars to an experiment tracker.

`scaletrain train` adds its progress bar and metrics.jsonl (scaletrain.train.observers),
and a `Trainer` takes a user's own. An observer overrides
the methods it cares about; the others do nothing. Events are plain data: an observer
needs no Runtime, strategy or model to read them.

Observers run on the training thread between steps, so they must be cheap: a
step's loss is a tensor on the device (reading it syncs a GPU), and `on_log`
carries the numbers already read once per logging window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EvalEvent", "EventBus", "LoopObserver", "RunInfo", "StepEvent", "say_off"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The run about to train (sent once, before the first step)."""

    out: Path
    """The run directory."""
    rank: int
    world_size: int
    start_step: int
    """Steps already done (a resumed run starts past 0)."""
    total_steps: int
    steps_per_epoch: int
    epochs: int
    global_batch: int
    """Samples per optimizer step over all data-parallel replicas."""
    header: Sequence[str] = ()
    """Lines that describe the run to a person (recipe, data, strategy, batch, lr)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The resolved configuration (what config.json holds)."""


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One optimizer step, just finished on this rank."""

    step: int
    """Optimizer steps done, this one included (1 after the first step)."""
    epoch: int
    """0-based epoch this step belongs to."""
    step_in_epoch: int
    """Steps done in this epoch, this one included."""
    steps_in_epoch: int
    lr: float
    """Learning rate this step used."""
    loss: Any
    """Mean loss over the step's micro-batches: a detached tensor on the device (reading
    it with .item() synchronises a GPU; do it rarely)."""
    samples: int
    """Samples in this step over all data-parallel replicas."""
    start: float
    """time.perf_counter() when the step began (before its first batch was fetched)."""
    end: float
    """time.perf_counter() when the optimizer step returned."""
    data_s: float
    """Seconds of [start, end] spent waiting for the loader."""


@dataclass(frozen=True, slots=True)
class EvalEvent:
    """An evaluation over the test set (or --eval-batches of it), reduced over ranks."""

    step: int
    epoch: int
    loss: float
    accuracy: float
    count: int
    """Samples (or tokens) counted, each once over all ranks."""
    unit: str = "samples"
    metric: str = "val_acc"


class LoopObserver:
    """What hears the loop's events: subclass it and override the events you need. Every
    method runs on every rank that has the observer (the trainer gives rank-0-only
    observers to rank 0 alone)."""

    reports: str = ""
    """What this observer only reports ("the progress display", "metrics.jsonl"), for the
    one line said if it fails: such an observer's errors never stop training (it is
    dropped, and the run goes on). Empty: it takes part in the run (the watchdog, the
    ledger's collectives), and its errors are the run's."""

    def on_run_start(self, info: RunInfo) -> None:
        return None

    def on_epoch_start(self, epoch: int, epochs: int, steps_in_epoch: int, done: int) -> None:
        return None

    def on_step_end(self, event: StepEvent) -> None:
        return None

    def on_log(self, record: Mapping[str, Any]) -> None:
        """Every --log-every steps (and at an epoch's end): the window's mean loss,
        learning rate and samples/s, as numbers."""
        return None

    def on_epoch_end(self, epoch: int) -> None:
        return None

    def on_eval_batch(self, step: int) -> None:
        """After each evaluation batch (evaluation is progress, too)."""
        return None

    def on_eval(self, event: EvalEvent) -> None:
        return None

    def on_save(self, step: int, path: Path) -> None:
        return None

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        """The run stopped early (signal, --stop-after) after saving `path`."""
        return None

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        """The run finished; `summary` is the last metrics record."""
        return None

    def close(self) -> None:
        """Always called last, also when the run failed: release files and threads."""
        return None


def say_off(reports: str, exc: BaseException) -> None:
    """The one line said when what only reports fails: it is off, training goes on."""
    from scaletrain.observe.output import tell

    tell(
        f"scaletrain: {reports} failed ({type(exc).__name__}: {exc}) and is off for the "
        "rest of the run; training goes on."
    )


class EventBus(LoopObserver):
    """The loop's observers as one: each event goes to each, in order. An observer that
    only reports (`LoopObserver.reports`) and fails is dropped with one line on stderr;
    the others' errors propagate."""

    def __init__(self, observers: Iterable[LoopObserver] = ()) -> None:
        self.members: list[LoopObserver] = list(observers)

    def add(self, observer: LoopObserver) -> None:
        self.members.append(observer)

    def _each(self, event: str, *args: Any) -> None:
        for o in list(self.members):
            if not o.reports:
                getattr(o, event)(*args)
                continue
            try:
                getattr(o, event)(*args)
            except Exception as exc:
                self._drop(o, exc)

    def _drop(self, observer: LoopObserver, exc: Exception) -> None:
        self.members.remove(observer)
        with contextlib.suppress(Exception):
            observer.close()
        say_off(observer.reports, exc)

    def on_run_start(self, info: RunInfo) -> None:
        self._each("on_run_start", info)

    def on_epoch_start(self, epoch: int, epochs: int, steps_in_epoch: int, done: int) -> None:
        self._each("on_epoch_start", epoch, epochs, steps_in_epoch, done)

    def on_step_end(self, event: StepEvent) -> None:
        self._each("on_step_end", event)

    def on_log(self, record: Mapping[str, Any]) -> None:
        self._each("on_log", record)

    def on_epoch_end(self, epoch: int) -> None:
        self._each("on_epoch_end", epoch)

    def on_eval_batch(self, step: int) -> None:
        self._each("on_eval_batch", step)

    def on_eval(self, event: EvalEvent) -> None:
        self._each("on_eval", event)

    def on_save(self, step: int, path: Path) -> None:
        self._each("on_save", step, path)

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        self._each("on_stop", step, total_steps, reason, path)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self._each("on_run_end", summary)

    def close(self) -> None:
        # Every observer gets closed even if one fails; the first failure of one that
        # takes part in the run is raised (one that only reports is said and dropped).
        error: BaseException | None = None
        for o in list(self.members):
            try:
                o.close()
            except Exception as exc:
                if o.reports:
                    self._drop(o, exc)
                else:
                    error = error or exc
        if error is not None:
            raise error
