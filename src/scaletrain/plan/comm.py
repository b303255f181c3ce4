"""Collectives as alpha-beta costs, and a short probe that measures alpha and beta here.

A ring over N ranks (what NCCL and Gloo use for large tensors) moves, per rank,
2(N-1)/N x bytes for an all-reduce (a reduce-scatter then an all-gather) and (N-1)/N x
bytes for an all-gather or a reduce-scatter (bytes = the whole, unsharded tensor), in
2(N-1) and N-1 messages:

    all_reduce      2(N-1) alpha + 2(N-1)/N bytes / bandwidth
    all_gather      (N-1) alpha  + (N-1)/N bytes / bandwidth
    reduce_scatter  (N-1) alpha  + (N-1)/N bytes / bandwidth
    send            alpha        + bytes / bandwidth

The links come from a datasheet profile, or from this machine's probe
(scaletrain.plan.probe), which also measures what ranks sharing this machine cost each
other (`meeting`, `Concurrency`, `step_growth`, `step_cpu`, `send_cpu`, `stage_hop`): all of it
lands here, in a CommModel.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from scaletrain.plan.hardware import Link

__all__ = [
    "KINDS",
    "CommModel",
    "Concurrency",
    "collective_time",
    "fit_link",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _factors(kind: str, n: int) -> tuple[float, float]:
    """(messages, bytes moved per byte of the tensor) per rank for `kind` over n ranks."""
    if n <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return float(n - 1), (n - 1) / n
    if kind == "send":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one `kind` of an `nbytes` tensor over `n` ranks on `link`."""
    messages, moved = _factors(kind, n)
    if messages == 0:
        return 0.0
    return messages * link.alpha + moved * nbytes / link.bandwidth


def fit_link(kind: str, n: int, samples: Sequence[tuple[float, float]]) -> Link:
    """The Link whose `collective_time` fits (bytes, seconds) samples best (least squares)."""
    messages, moved = _factors(kind, n)
    xs = [b for b, _ in samples]
    ys = [t for _, t in samples]
    if len(set(xs)) < 2:
        b, t = samples[0]
        return Link(alpha=0.0, bandwidth=moved * b / max(t, 1e-9))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 1e-15)
    intercept = max(0.0, my - slope * mx)
    return Link(alpha=intercept / messages, bandwidth=moved / slope)


@dataclass(frozen=True, slots=True)
class Concurrency:
    """How ranks stepping side by side on this machine's cores slow each other."""

    ranks: int
    """Ranks that stepped at once (the group's size, at most the cores)."""
    factor: float
    """A rank's CPU seconds per step among them / alone (>= 1 when they contend for
    caches and memory bandwidth)."""
    spread: tuple[float, ...]
    """Steps' wall times among them, each over the median of its rank's turn (so about
    1 in the middle), sorted: how much one rank's step varies, which every synchronous
    rank waits for (see `sync`)."""
    alone: float = 0.0
    """CPU seconds of one plain step alone (rank 0's median; 0: not kept)."""

    def sync(self, ranks: int, weights: Sequence[float] | None = None) -> float:
        """Median of the slowest of `ranks` independent steps, over one step's median (the
        spread's values are already over it).

        Ranks that meet at every step (a collective) each wait for the slowest; the
        maximum of n draws is below a value v with probability F(v)^n, so its median
        is the 0.5^(1/n) quantile of one step's times.

        `weights`: one per rank, its work over the busiest's (default: all 1), for ranks whose
        work differs (a pipeline's stages). The slowest then ends below v with
        probability the product of F(v / w) over the ranks: a rank with a fraction of
        the busiest's work makes it wait only in the rare step where it runs that many
        times its median. The convnet recipe's 2-stage pipeline (its last stage 17% of
        the first's) spent 9.8-10.2 ms of its first stage's CPU in steps of 10.1-10.4
        ms, where the slowest of 2 equal ranks added 0.6 ms."""
        if weights is not None and len(weights) != ranks:
            raise ValueError(
                f"Concurrency.sync got {len(weights)} weights for {ranks} ranks; "
                "expected one weight per rank"
            )
        if ranks <= 1 or not self.spread:
            return 1.0
        top = max(weights, default=0.0) if weights is not None else 0.0
        if weights is None or top <= 0 or min(weights) >= top:
            return max(1.0, self._quantile(0.5 ** (1 / ranks)))
        # Over the spread's range, where F climbs from 0 to 1: bisect for F_max(v) = 0.5.
        shares = [w / top for w in weights if w > 0]
        lo, hi = self.spread[0], self.spread[-1]
        for _ in range(60):
            mid = (lo + hi) / 2
            below = 1.0
            for w in shares:
                below *= self._cdf(mid / w)
            lo, hi = (mid, hi) if below < 0.5 else (lo, mid)
        return max(1.0, (lo + hi) / 2)

    def _quantile(self, p: float) -> float:
        """The spread's p quantile, linear between its sorted values."""
        s = self.spread
        q = p * (len(s) - 1)
        lo = int(q)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (q - lo)

    def _cdf(self, v: float) -> float:
        """The inverse of `_quantile`: the share of steps below v (0 below the spread, 1
        above it)."""
        s = self.spread
        if v >= s[-1]:
            return 1.0
        if v < s[0] or len(s) == 1:
            return 0.0
        i = bisect.bisect_right(s, v) - 1  # s[i] <= v < s[i + 1]
        return (i + (v - s[i]) / (s[i + 1] - s[i])) / (len(s) - 1)


@dataclass(slots=True)
class CommModel:
    """Links per (collective, group size): measured here, or one profile's for all."""

    links: dict[tuple[str, int], Link] = field(default_factory=dict)
    default: Link | None = None
    source: str = "measured"
    runtime_bytes: dict[int, int] = field(default_factory=dict)
    """RSS a rank's process group and collectives added (bytes), by group size."""
    meeting: dict[int, float] = field(default_factory=dict)
    """By group size: seconds each blocking collective costs beyond the quiet one when
    the ranks come to it from work (measured on this CPU machine; none on a profile,
    where a device's own engines run the collectives)."""
    concurrency: dict[int, Concurrency] = field(default_factory=dict)
    """By group size: ranks stepping side by side (measured when the probe got the
    model's step)."""
    stage_hop: dict[int, Link] = field(default_factory=dict)
    """By group size: a pipeline's send between two stages as a stage makes it, the
    sender going on with its work and the other ranks computing (measured on this
    machine: where ranks outnumber cores, its I/O and its receiver wait for them)."""
    send_cpu: dict[int, float] = field(default_factory=dict)
    """By group size: CPU seconds one send or receive costs its process (measured on
    this machine: a pipeline stage pays it per microbatch at each boundary)."""
    step_growth: dict[tuple[str, int], int] = field(default_factory=dict)
    """By (strategy, group size): RSS the model's steps of that strategy over the whole
    group ("fsdp", "tensor") added after setup, on the largest rank (measured when the
    probe got those steps; see crowd.step_growth)."""
    busy: dict[tuple[str, int], Link] = field(default_factory=dict)
    """Per (collective, group size): the link fitted to the collective timed as a step
    reaches it, every rank coming from work (measured on this CPU machine, where the
    cores are busy up to it: see crowd.from_work)."""
    step_cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    """By (strategy, group size): a rank's CPU seconds per step of that strategy over the
    whole group ("fsdp", "tensor") at `batch` samples a rank, every rank stepping (its
    work between the collectives, not their own CPU; measured on this machine when the
    probe got those steps; see crowd.step_growth)."""
    batch: int | None = None
    """Samples per rank of the model's steps the probe ran (`step_cpu`'s)."""

    def time(self, kind: str, nbytes: float, n: int, link: Link | None = None) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        chosen = link or self.links.get((kind, n)) or self.default
        if chosen is None:
            # Measured at another group size only (a pipeline's 2-rank sends on a 4-process
            # probe): the nearest size's link for this collective.
            sizes = sorted((abs(m - n), m) for k, m in self.links if k == kind)
            chosen = self.links[(kind, sizes[0][1])] if sizes else None
        if chosen is None:
            raise KeyError(f"no link measured for {kind} over {n} ranks")
        return collective_time(kind, nbytes, n, chosen)
