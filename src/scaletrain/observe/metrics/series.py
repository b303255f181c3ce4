"""Per-step numbers of a window (kept until it closes) and of the run (running sums)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scaletrain.observe.metrics.clocks import StepTimes
from scaletrain.observe.metrics.phases import PHASES

__all__ = ["CompileTally", "Reduced", "Series", "Totals", "mean", "median", "union_length"]


def median(values: Sequence[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if len(values) else float("nan")


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


@dataclass(frozen=True, slots=True)
class Reduced:
    """A series reduced to one number per quantity (medians or means)."""

    steps: int
    wall: float
    phases: list[float]
    comm_busy: float
    overlap: float
    cpu: float
    means: list[float]
    """Each phase's mean, whatever `phases` holds: a run-queue wait is a total over the
    steps, so what it is compared with must be a mean too (a median of steps of which
    6 in 10 waited is the waited step's, 1.7x the mean)."""


class Series:
    """A window's counted steps: one append per step; columns only when it closes."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[float], float, float, float | None, float | None]] = []

    def add(self, times: StepTimes, cpu: float, busy: float | None, overlap: float | None) -> None:
        self.rows.append((times.seconds, times.wall, cpu, busy, overlap))

    def __len__(self) -> int:
        return len(self.rows)

    def reduce(self, stat: Callable[[Sequence[float]], float] = median) -> Reduced:
        rows = self.rows
        return Reduced(
            steps=len(rows),
            wall=stat([r[1] for r in rows]),
            phases=[stat([r[0][i] for r in rows]) for i in range(len(PHASES))],
            comm_busy=stat([r[3] for r in rows if r[3] is not None]),
            overlap=stat([r[4] for r in rows if r[4] is not None]),
            cpu=stat([r[2] for r in rows]),
            means=[mean([r[0][i] for r in rows]) for i in range(len(PHASES))],
        )


@dataclass(slots=True)
class CompileTally:
    """torch.compile's seconds over the steps that compiled (a window's or the run's).

    Those steps are left out of Series and Totals (their statistics would measure the
    compiler, not training): this is all that is kept of them."""

    seconds: float = 0.0
    steps: int = 0
    first: int = 0
    """The first step that compiled (0: none)."""
    last: int = 0

    def add(self, step: int, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.first = self.first or step
        self.last = step


class Totals:
    """The whole run's counted steps as running sums (constant memory): means."""

    def __init__(self) -> None:
        self.steps = 0
        self.phases = [0.0] * len(PHASES)
        self.wall = self.cpu = self.busy = self.overlap = 0.0
        self.n_busy = self.n_overlap = 0
        self.last: StepTimes | None = None

    def add(self, times: StepTimes, cpu: float, busy: float | None, overlap: float | None) -> None:
        self.steps += 1
        sums = self.phases
        for i, s in enumerate(times.seconds):
            sums[i] += s
        self.wall += times.wall
        self.cpu += cpu
        if busy is not None:
            self.busy += busy
            self.n_busy += 1
        if overlap is not None:
            self.overlap += overlap
            self.n_overlap += 1
        self.last = times

    def reduce(self) -> Reduced:
        def div(total: float, n: int) -> float:
            return total / n if n else float("nan")

        phases = [div(s, self.steps) for s in self.phases]
        return Reduced(
            steps=self.steps,
            wall=div(self.wall, self.steps),
            phases=phases,
            comm_busy=div(self.busy, self.n_busy),
            overlap=div(self.overlap, self.n_overlap),
            cpu=div(self.cpu, self.steps),
            means=list(phases),
        )
