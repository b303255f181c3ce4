"""Per-step numbers kept compactly (arrays of doubles), and the statistics taken of them."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from scaletrain.observe.clocks import StepTimes
from scaletrain.observe.phases import PHASES

__all__ = ["Series", "mean", "median", "union_length"]


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


class Series:
    """Per-step numbers of counted steps (a window's, or the whole run's), compact."""

    def __init__(self) -> None:
        self.phases = [array("d") for _ in PHASES]
        self.wall = array("d")
        self.cpu = array("d")
        self.comm_busy = array("d")
        self.overlap = array("d")

    def add(self, times: StepTimes, cpu: float, busy: float | None, overlap: float | None) -> None:
        for i, s in enumerate(times.seconds):
            self.phases[i].append(s)
        self.wall.append(times.wall)
        self.cpu.append(cpu)
        if busy is not None:
            self.comm_busy.append(busy)
        if overlap is not None:
            self.overlap.append(overlap)

    def __len__(self) -> int:
        return len(self.wall)
