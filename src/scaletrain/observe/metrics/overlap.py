"""Overlap of communication with compute in a profiler trace, as Holistic Trace Analysis
defines it.

HTA, per rank: take the communication kernels (NCCL) and the union of the compute
kernels (every other kernel) on the GPU;

    overlap % = |comm ∩ compute| / |comm|        exposed = |comm| - |comm ∩ compute|

where |x| is the total length of a union of intervals. On CPU with Gloo there are no
kernels: Gloo's worker thread (`pt_gloo_runloop`, its "gloo:*" spans) stands in for the
communication stream and the operators of the training threads for compute (c10d
calls on those threads only enqueue or wait: they are not compute).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OverlapStats",
    "analyze_trace",
    "intersection_length",
    "load_trace",
    "overlap_stats",
    "trace_intervals",
    "union",
]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    merged: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersection_length(a: list[Interval], b: list[Interval]) -> float:
    """|A ∩ B| for two unions (sorted, disjoint), in one merge pass."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True, slots=True)
class OverlapStats:
    comm_s: float
    """|comm|: seconds some communication was running."""
    compute_s: float
    overlapped_s: float
    exposed_s: float
    """Communication not hidden behind compute."""

    @property
    def overlap(self) -> float | None:
        """Fraction of communication time overlapped by compute (None: no communication)."""
        return self.overlapped_s / self.comm_s if self.comm_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "overlapped_s": self.overlapped_s,
            "exposed_s": self.exposed_s,
            "overlap": self.overlap,
        }


def overlap_stats(comm: Iterable[Interval], compute: Iterable[Interval]) -> OverlapStats:
    """HTA's numbers for interval sets in seconds (or any one unit)."""
    c, k = union(comm), union(compute)
    comm_len, both = length(c), intersection_length(c, k)
    return OverlapStats(comm_len, length(k), both, comm_len - both)


_COMM_PREFIXES = ("nccl", "gloo", "c10d", "record_param_comms", "mpi:", "ucc")


def _is_comm_name(name: str) -> bool:
    return name.lower().startswith(_COMM_PREFIXES) or "nccl" in name.lower()


def trace_intervals(trace: dict[str, Any]) -> tuple[list[Interval], list[Interval], str]:
    """(comm, compute, kind) intervals in seconds from a chrome trace; kind is "cuda"
    when the trace has GPU kernels, else "cpu"."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm: list[Interval] = []
    compute: list[Interval] = []
    if kernels:
        for e in kernels:
            span = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            (comm if "nccl" in e.get("name", "").lower() else compute).append(span)
        return comm, compute, "cuda"
    gloo_threads = {
        (e.get("pid"), e.get("tid"))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and "gloo" in str((e.get("args") or {}).get("name", "")).lower()
    }
    for e in events:
        span = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        name = e.get("name", "")
        if (e.get("pid"), e.get("tid")) in gloo_threads:
            if name.lower().startswith("gloo"):
                comm.append(span)
        elif e.get("cat") == "cpu_op" and not _is_comm_name(name):
            compute.append(span)
    return comm, compute, "cpu"


def load_trace(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def analyze_trace(path: str | Path) -> tuple[OverlapStats, str]:
    """HTA's overlap numbers for one rank's trace file, and the trace's kind."""
    comm, compute, kind = trace_intervals(load_trace(path))
    return overlap_stats(comm, compute), kind
