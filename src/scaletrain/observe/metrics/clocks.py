"""Timelines that turn phase switches into seconds per phase: wall clock or CUDA events.

A timeline is told, at each phase switch, which phase just ended; at the end of a step
it hands back the step's seconds per phase. The two kinds:

- `WallTimeline` (CPU, Gloo): `time.perf_counter()` at each switch, summed at once.
- `CudaTimeline`: a CUDA event recorded on the current stream at each switch. The
  intervals between consecutive events are the stream's own timeline: time the GPU
  spent between two phase boundaries, including time it sat idle waiting for the host
  (a data wait the GPU could not hide shows up as `data`). Events are read one step
  late, when `query()` says the last one completed: the hot path never synchronises.
  Megatron's timers call `cuda.synchronize()` at every start and stop, which changes
  what they measure; this does not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["CudaTimeline", "StepTimes", "Timeline", "WallTimeline"]


@dataclass(slots=True)
class StepTimes:
    """One step's seconds per phase (indexed like PHASES) and its wall time."""

    seconds: list[float]
    wall: float
    tag: Any = None
    """Whatever the ledger attached when the step closed (its step number, flags)."""


class Timeline(Protocol):
    kind: str

    def switch(self, ended: int) -> None: ...

    def close(self, ended: int, tag: Any) -> None: ...

    def ready(self) -> list[StepTimes]: ...

    def flush(self) -> list[StepTimes]: ...

    def restart(self) -> None: ...


class WallTimeline:
    """Host wall clock: exact on CPU, where the host does the work."""

    kind = "wall"

    def __init__(self, n_phases: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self._n = n_phases
        self._clock = clock
        self._acc = [0.0] * n_phases
        self._last = self._start = clock()
        self._done: list[StepTimes] = []

    def restart(self) -> None:
        """Forget the time since the last switch (the ledger was idle: before the first
        step, after evaluation in a loop that never told us)."""
        self._acc = [0.0] * self._n
        self._last = self._start = self._clock()

    def switch(self, ended: int) -> None:
        now = self._clock()
        self._acc[ended] += now - self._last
        self._last = now

    def close(self, ended: int, tag: Any) -> None:
        self.switch(ended)
        self._done.append(StepTimes(self._acc, self._last - self._start, tag))
        self._acc = [0.0] * self._n
        self._start = self._last

    def ready(self) -> list[StepTimes]:
        done, self._done = self._done, []
        return done

    def flush(self) -> list[StepTimes]:
        return self.ready()


class CudaTimeline:
    """CUDA events on the current stream, resolved one step late.

    `event_factory` makes a timing event (torch.cuda.Event(enable_timing=True)); tests
    pass fakes with the same `record()`, `query()` and `elapsed_time()`.
    """

    kind = "cuda"

    def __init__(self, n_phases: int, event_factory: Callable[[], Any] | None = None) -> None:
        if event_factory is None:
            import torch

            def event_factory() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._n = n_phases
        self._factory = event_factory
        self._pool: list[Any] = []
        self._start = self._event()
        self._marks: list[tuple[Any, int]] = []
        self._pending: deque[tuple[Any, list[tuple[Any, int]], Any]] = deque()

    def _event(self) -> Any:
        event = self._pool.pop() if self._pool else self._factory()
        event.record()
        return event

    def restart(self) -> None:
        # The old start may be the last event of a pending step: it is not reused.
        self._pool.extend(e for e, _ in self._marks)
        self._marks = []
        self._start = self._event()

    def switch(self, ended: int) -> None:
        self._marks.append((self._event(), ended))

    def close(self, ended: int, tag: Any) -> None:
        self.switch(ended)
        self._pending.append((self._start, self._marks, tag))
        # The next step starts where this one ended: the same event, not a new one.
        self._start = self._marks[-1][0]
        self._marks = []

    def _resolve(self, start: Any, marks: list[tuple[Any, int]], tag: Any) -> StepTimes:
        seconds = [0.0] * self._n
        previous = start
        for event, ended in marks:
            seconds[ended] += previous.elapsed_time(event) / 1e3
            previous = event
        wall = start.elapsed_time(marks[-1][0]) / 1e3
        # Events are reused once read; the last one is the next step's start: kept until
        # that step is read (steps are read in order).
        self._pool.append(start)
        self._pool.extend(e for e, _ in marks[:-1])
        return StepTimes(seconds, wall, tag)

    def ready(self) -> list[StepTimes]:
        """Steps whose last event has completed; never waits."""
        done = []
        while self._pending and self._pending[0][1][-1][0].query():
            done.append(self._resolve(*self._pending.popleft()))
        return done

    def flush(self) -> list[StepTimes]:
        """Every pending step, waiting for its events (at the end of a run only)."""
        done = []
        while self._pending:
            start, marks, tag = self._pending.popleft()
            marks[-1][0].synchronize()
            done.append(self._resolve(start, marks, tag))
        return done
