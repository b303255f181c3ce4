"""What one rank contributes to a window's gather, and the cross-rank view built from it.

Every K steps each rank packs a few numbers about its last window (medians and means
per phase, memory, FLOPs) into one small float vector; ONE all-gather gives every rank every
rank's vector (a few hundred bytes each), so every rank computes the same min / median
/ max per phase, with the rank that holds each extreme, without a second collective.
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scaletrain.observe.metrics.phases import COMM, PHASES, SYNC
from scaletrain.observe.metrics.series import CompileTally, Reduced

__all__ = ["PhaseSpread", "RankWindow", "WindowStats", "pack", "summarize", "unpack"]

_NAN = float("nan")


@dataclass(slots=True)
class RankWindow:
    """One rank's numbers for a window (medians over its steps, and `means`)."""

    rank: int
    peer_group: int
    """Ranks that do the same work share a group (a pipeline stage each); stragglers are
    only sought among peers."""
    steps: int
    wall: float
    phases: list[float]
    comm_busy: float = _NAN
    """Seconds per step some gradient bucket was being reduced (NaN where not timed)."""
    overlap: float = _NAN
    """Fraction of comm_busy hidden behind backward's compute (NaN where not timed)."""
    cpu: float = _NAN
    """Process CPU seconds per step (all threads)."""
    allocated_peak: float = _NAN
    reserved_peak: float = _NAN
    rss_peak: float = _NAN
    gpu_util: float = _NAN
    flops: float = _NAN
    """FLOPs this rank executes per step (counted once), NaN if not counted."""
    host_id: float = 0.0
    """A number naming the host (a hash), to group ranks by node."""
    cpu_wait: float = _NAN
    """Seconds per step the training thread waited for a CPU (runnable, in the kernel's
    run queue: other processes had its core); NaN where the kernel does not say."""
    compile_s: float = 0.0
    """Seconds torch.compile took over the window's (or run's) steps that compiled; those
    steps are not in `steps`, `wall` or `phases`."""
    compile_steps: float = 0.0
    """How many steps compiled."""
    compile_first: float = 0.0
    """The first and last of them (0: none)."""
    compile_last: float = 0.0
    means: list[float] = field(default_factory=list)
    """Each phase's mean over the window's steps (empty: the same as `phases`), which a
    run-queue wait, a total over the steps, is compared with."""

    def mean_of(self, i: int) -> float:
        return self.means[i] if self.means else self.phases[i]

    @property
    def waited(self) -> float:
        """Seconds per step blocked in collectives (exposed comm + sync)."""
        return self.phases[COMM] + self.phases[SYNC]


_SCALARS = (
    "comm_busy",
    "overlap",
    "cpu",
    "allocated_peak",
    "reserved_peak",
    "rss_peak",
    "gpu_util",
    "flops",
    "host_id",
    "cpu_wait",
    "compile_s",
    "compile_steps",
    "compile_first",
    "compile_last",
)
PHASES_AT = 4
"""Where the packed vector holds the phases' medians (after rank, group, steps, wall),"""
MEANS_AT = PHASES_AT + len(PHASES)
"""their means,"""
SCALARS_AT = MEANS_AT + len(PHASES)
"""and `_SCALARS`, in that order."""
VECTOR_LEN = SCALARS_AT + len(_SCALARS)


def pack(window: RankWindow) -> list[float]:
    """The float vector a rank sends (fixed length: every rank's must match)."""
    head = [float(window.rank), float(window.peer_group), float(window.steps), window.wall]
    means = [window.mean_of(i) for i in range(len(PHASES))]
    return head + list(window.phases) + means + [float(getattr(window, k)) for k in _SCALARS]


def unpack(rows: Sequence[Sequence[float]]) -> list[RankWindow]:
    out = []
    for row in rows:
        values = dict(zip(_SCALARS, row[SCALARS_AT:], strict=True))
        out.append(
            RankWindow(
                rank=int(row[0]),
                peer_group=int(row[1]),
                steps=int(row[2]),
                wall=float(row[3]),
                phases=[float(x) for x in row[PHASES_AT:MEANS_AT]],
                means=[float(x) for x in row[MEANS_AT:SCALARS_AT]],
                **values,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class PhaseSpread:
    """A phase over the ranks: fastest, median and slowest, with who."""

    phase: str
    min: float
    min_rank: int
    median: float
    max: float
    max_rank: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "min_rank": self.min_rank,
            "median": self.median,
            "max": self.max,
            "max_rank": self.max_rank,
        }


def spread(name: str, values: Sequence[tuple[int, float]]) -> PhaseSpread:
    """(rank, value) pairs -> min/median/max; ties go to the lowest rank."""
    finite = [(r, v) for r, v in values if not math.isnan(v)]
    if not finite:
        return PhaseSpread(name, _NAN, -1, _NAN, _NAN, -1)
    lo = min(finite, key=lambda rv: (rv[1], rv[0]))
    hi = max(finite, key=lambda rv: (rv[1], -rv[0]))
    return PhaseSpread(name, lo[1], lo[0], statistics.median(v for _, v in finite), hi[1], hi[0])


@dataclass(slots=True)
class WindowStats:
    """Every rank's window, and the spread of each phase over ranks."""

    first_step: int
    last_step: int
    ranks: list[RankWindow]
    spreads: dict[str, PhaseSpread] = field(default_factory=dict)

    @classmethod
    def build(cls, first_step: int, last_step: int, ranks: list[RankWindow]) -> WindowStats:
        ranks = sorted(ranks, key=lambda w: w.rank)
        spreads = {
            name: spread(name, [(w.rank, w.phases[i]) for w in ranks])
            for i, name in enumerate(PHASES)
        }
        spreads["step"] = spread("step", [(w.rank, w.wall) for w in ranks])
        return cls(first_step, last_step, ranks, spreads)

    def as_dict(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "spreads": {k: v.as_dict() for k, v in self.spreads.items()},
            "ranks": [
                {
                    "rank": w.rank,
                    "peer_group": w.peer_group,
                    "steps": w.steps,
                    "wall": w.wall,
                    "phases": dict(zip(PHASES, w.phases, strict=True)),
                    **{k: clean(getattr(w, k)) for k in _SCALARS if k != "host_id"},
                }
                for w in self.ranks
            ],
        }


def _num(x: float | int | None) -> float:
    return float("nan") if x is None else float(x)


def summarize(
    reduced: Reduced,
    *,
    rank: int,
    peer_group: int,
    sample: Any,
    flops: float | None,
    host: str,
    cpu_wait: float | None = None,
    compiled: CompileTally | None = None,
) -> RankWindow:
    """This rank's window from its reduced series (medians for a window, means for the
    whole run), a memory sample, its run-queue wait per step and what its steps that
    compiled took to compile."""
    compiled = compiled or CompileTally()
    return RankWindow(
        rank=rank,
        peer_group=peer_group,
        steps=reduced.steps,
        wall=reduced.wall,
        phases=list(reduced.phases),
        means=list(reduced.means),
        comm_busy=reduced.comm_busy,
        overlap=reduced.overlap,
        cpu=reduced.cpu,
        allocated_peak=_num(sample.allocated_peak if sample else None),
        reserved_peak=_num(sample.reserved_peak if sample else None),
        rss_peak=_num(sample.rss_peak if sample else None),
        gpu_util=_num(sample.gpu_util if sample else None),
        flops=_num(flops),
        host_id=float(zlib.crc32(host.encode()) % 2**24),
        cpu_wait=_num(cpu_wait),
        compile_s=compiled.seconds,
        compile_steps=float(compiled.steps),
        compile_first=float(compiled.first),
        compile_last=float(compiled.last),
    )
