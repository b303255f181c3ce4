"""Name the rank that holds the job back, the phase that makes it slow, and what it costs.

Per window (the ledger's gather every K steps) and per phase that a rank does on its
own (data, h2d, forward, backward, optimizer; collectives are left out because they make
every rank equally long), each rank gets two scores, as NVIDIA's straggler detector
(NVRx) defines them:

- relative: (the fastest peer's median) / (own median), 1.0 for the fastest rank;
- individual: (own best window median so far) / (own median now), < 1 when a rank
  degrades over time (thermal throttling, a noisy neighbour).

A rank is a candidate in a window when, in some phase, its typical peer (the median of
the others) takes less than `threshold` of its time AND the excess is at least
`min_cost` (5%) of the step, in a window of at least `min_steps` steps, and its peers wait for
it (DeepSpeed-style, below) at least as much: a tiny phase that is 2x slower but costs 0.1% of the step names
nobody, and the minimum of several noisy ranks (biased low) does not make every other
rank look slow. It is named once
it stays a candidate for `patience` windows in a row (one window can be noise).

Unlike HTA, which always lists its top-k "stragglers" however even the ranks are, this
names nobody on a balanced job. The cost is measured as DeepSpeed's comms logger
measures waits: each rank's time blocked in collectives minus the minimum over ranks
(no clock synchronisation needed); the slow rank waits least, its peers wait for it.
Ranks are only compared with peers that do the same work (the same pipeline stage).

A rank can be slow without anything wrong with its device: the kernel ran other
processes on its core while it was ready to run (a crowded host, more ranks than cores).
Each window carries the training thread's run-queue wait per step (Linux schedstat,
observe/metrics/runqueue.py, read once per window). When the slow rank waited for a CPU at
least as long as it is slower than its typical peer (and for at least 5% of the step),
the wait accounts for its slowness, and it is named with it ("rank 1 waited 8.0 ms/step
for a CPU") instead of with the phase the wait happened to fall in. Its peers may have
waited as long: on a crowded host every rank waits, and whichever the scheduler runs
last in a phase looks slow there; the per-window total cannot say in which phase a wait
fell, only that it can account for the slowness. Where the kernel does not say (no
/proc), nothing is said about CPU waits.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scaletrain.observe.metrics.phases import COMPUTE_PHASES, PHASES, STRAGGLER_PHASES
from scaletrain.observe.metrics.window import RankWindow, WindowStats

__all__ = ["Straggler", "StragglerDetector", "StragglerOptions", "what_slowed"]

_COMPUTE = "compute"


@dataclass(frozen=True, slots=True)
class StragglerOptions:
    threshold: float = 0.9
    """Relative score below which a rank is slow in a phase (0.9: >= 11% slower)."""
    patience: int = 2
    """Windows in a row a rank must be slow before it is named."""
    min_cost: float = 0.05
    """The excess must be at least this fraction of the step's median wall time."""
    min_excess_s: float = 2e-4
    """...and at least this many seconds (timer resolution and jitter)."""
    min_steps: int = 8
    """Windows with fewer counted steps give no verdict (a median of 2 steps is noise)."""
    cpu_wait_share: float = 1.0
    """A slow rank is slow because it waited for a CPU when its run-queue wait per step
    is at least this multiple of how much slower it is than its typical peer."""


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank named as slow."""

    rank: int
    phase: str
    """The phase that makes it slow ("data", "forward", ... or "compute" when the whole
    of its compute is slower without one phase standing out)."""
    score: float
    """Relative score: fastest peer's median / own median."""
    individual: float
    """Own best window median so far / own median now."""
    slower: float
    """Own median / fastest peer's median (1.25: 25% slower)."""
    excess_s: float
    """Seconds per step this rank spends in `phase` beyond the fastest peer."""
    cost_s: float
    """Seconds per step its peers wait for it (mean over peers of own wait minus the
    minimum wait)."""
    step_s: float
    """The job's median step time in that window."""
    first_step: int
    last_step: int
    """The window in which it was named."""
    cpu_wait_s: float | None = None
    """Seconds per step it waited for a CPU (run queue); None where not known."""
    peer_cpu_wait_s: float | None = None
    """The same for its typical peer (the median of the others)."""
    waited_for_cpu: bool = False
    """Slow mostly because it waited for a CPU (other processes on its host), not
    because of its device or its own work."""

    @property
    def cost_fraction(self) -> float:
        return self.cost_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "phase": self.phase,
            "score": self.score,
            "individual": self.individual,
            "slower": self.slower,
            "excess_s": self.excess_s,
            "cost_s": self.cost_s,
            "step_s": self.step_s,
            "cost_fraction": self.cost_fraction,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "cpu_wait_s": self.cpu_wait_s,
            "peer_cpu_wait_s": self.peer_cpu_wait_s,
            "waited_for_cpu": self.waited_for_cpu,
        }

    def describe(self, host: str | None = None) -> str:
        where = f" ({host})" if host else ""
        if self.waited_for_cpu:
            wait = self.cpu_wait_s or 0.0
            peers = (
                f"; its peers {self.peer_cpu_wait_s * 1e3:.1f} ms"
                if self.peer_cpu_wait_s is not None
                else ""
            )
            return (
                f"straggler: rank {self.rank}{where} waited {wait * 1e3:.1f} ms/step for a "
                f"CPU (other processes on its host{peers}) "
                f"over steps {self.first_step}-{self.last_step}, so its peers wait "
                f"{self.cost_s * 1e3:.1f} ms per step for it ({self.cost_fraction:.0%} of the "
                f"{self.step_s * 1e3:.1f} ms step). Not its device: fewer processes on that "
                "host than it has cores, or other jobs moved off it, make it even."
            )
        return (
            f"straggler: rank {self.rank}{where} is slow in {self.phase}: "
            f"{self.slower:.2f}x the fastest peer's median (score {self.score:.2f}) over "
            f"steps {self.first_step}-{self.last_step}; its peers wait "
            f"{self.cost_s * 1e3:.1f} ms per step for it ({self.cost_fraction:.0%} of the "
            f"{self.step_s * 1e3:.1f} ms step)."
        )


def what_slowed(straggler: Mapping[str, Any]) -> str:
    """A named straggler (`Straggler.as_dict()`, as summary.json keeps them) in a few
    words: its wait for a CPU when that is the cause, else its slow phase."""
    if straggler.get("waited_for_cpu") and straggler.get("cpu_wait_s") is not None:
        return (
            f"waited {straggler['cpu_wait_s'] * 1e3:.1f} ms/step for a CPU "
            "(other processes on its host)"
        )
    return f"slow in {straggler['phase']} ({straggler['slower']:.2f}x)"


def _phase_value(w: RankWindow, phase: str) -> float:
    if phase == _COMPUTE:
        return sum(w.phases[i] for i in COMPUTE_PHASES)
    return w.phases[PHASES.index(phase)]


@dataclass(slots=True)
class StragglerDetector:
    """Fed every window on every rank (the same stats everywhere: the same verdicts)."""

    options: StragglerOptions = field(default_factory=StragglerOptions)
    named: dict[int, Straggler] = field(default_factory=dict)
    """Every rank named so far, with the window it was named in."""
    streak: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    best: dict[tuple[int, str], float] = field(default_factory=dict)
    candidates: dict[int, Straggler] = field(default_factory=dict)
    """This window's candidates (slow now, named or not)."""

    def update(self, stats: WindowStats) -> list[Straggler]:
        """Score one window; return the ranks named for the first time in it."""
        opts = self.options
        groups: dict[int, list[RankWindow]] = defaultdict(list)
        for w in stats.ranks:
            if w.steps >= opts.min_steps:
                groups[w.peer_group].append(w)
        judged = {w.rank for peers in groups.values() if len(peers) > 1 for w in peers}
        self.candidates = {}
        phases = [PHASES[i] for i in STRAGGLER_PHASES] + [_COMPUTE]
        for peers in groups.values():
            for w in peers:
                for phase in phases:
                    value = _phase_value(w, phase)
                    key = (w.rank, phase)
                    self.best[key] = min(self.best.get(key, value), value)
            if len(peers) < 2:
                continue
            step = statistics.median(w.wall for w in peers)
            least_wait = min(w.waited for w in peers)
            for w in peers:
                found = self._slowest_phase(w, peers, phases, step)
                if found is None:
                    continue
                phase, fastest, value = found
                others = [p for p in peers if p.rank != w.rank]
                cost = statistics.fmean(p.waited - least_wait for p in others)
                if cost < opts.min_cost * step:
                    # Slower, but its peers hardly wait for it (it catches up elsewhere,
                    # or the phase overlaps): no cost to the job, no name.
                    continue
                own_wait, peer_wait, waited = self._cpu_wait(w, others, phase, step)
                self.candidates[w.rank] = Straggler(
                    rank=w.rank,
                    phase=phase,
                    score=fastest / value if value > 0 else 1.0,
                    individual=self.best[(w.rank, phase)] / value if value > 0 else 1.0,
                    slower=value / fastest if fastest > 0 else float("inf"),
                    excess_s=value - fastest,
                    cost_s=max(cost, 0.0),
                    step_s=step,
                    first_step=stats.first_step,
                    last_step=stats.last_step,
                    cpu_wait_s=own_wait,
                    peer_cpu_wait_s=peer_wait,
                    waited_for_cpu=waited,
                )
        newly = []
        for w in stats.ranks:
            if w.rank not in judged:
                continue  # no verdict this window: the streak stands
            if w.rank in self.candidates:
                self.streak[w.rank] += 1
                if self.streak[w.rank] >= opts.patience and w.rank not in self.named:
                    self.named[w.rank] = self.candidates[w.rank]
                    newly.append(self.candidates[w.rank])
            else:
                self.streak[w.rank] = 0
        return newly

    def _cpu_wait(
        self, w: RankWindow, others: list[RankWindow], phase: str, step: float
    ) -> tuple[float | None, float | None, bool]:
        """`w`'s run-queue wait per step, its typical peer's (None where not known), and
        whether that wait accounts for its slowness: at least `cpu_wait_share` times the
        larger of its excess in its slow phase and in all its own work (the phases it does
        alone) over its typical peer, and at least `min_cost` of the step.

        The wait is a window's total over its steps, so it is held against the rank's
        mean, not the median that found the slow phase: a host that starves a rank in 6
        steps of 10 makes its median step a starved one, 1.7x the wait per step over its
        peer's, and would blame the phase the wait fell in. Its peers' part stays their
        median, which one stall of a peer's does not move (a peer's mean would, and clear
        a rank slow on every step). The wait is over every step since the last window,
        warm-up and compiling ones too, the means over the counted ones: close, not exact,
        in the first window."""
        opts = self.options
        if math.isnan(w.cpu_wait):
            return None, None, False
        own = w.cpu_wait
        waits = [p.cpu_wait for p in others if not math.isnan(p.cpu_wait)]
        typical = statistics.median(waits) if waits else None

        def excess(indices: tuple[int, ...]) -> float:
            mine = sum(w.mean_of(i) for i in indices)
            return mine - statistics.median(sum(p.phases[i] for i in indices) for p in others)

        in_phase = excess(COMPUTE_PHASES if phase == _COMPUTE else (PHASES.index(phase),))
        slower_by = max(in_phase, excess(STRAGGLER_PHASES))
        waited = own >= max(opts.cpu_wait_share * slower_by, opts.min_cost * step)
        return own, typical, waited

    def _slowest_phase(
        self, w: RankWindow, peers: list[RankWindow], phases: list[str], step: float
    ) -> tuple[str, float, float] | None:
        """The phase with the largest excess among those that make `w` slow, if any."""
        opts = self.options
        worst: tuple[str, float, float] | None = None
        worst_excess = 0.0
        for phase in phases:
            value = _phase_value(w, phase)
            fastest = min(_phase_value(p, phase) for p in peers)
            # Slow against its typical peer (the median of the others), not only against
            # the fastest: the minimum of several noisy ranks is biased low.
            typical = statistics.median(_phase_value(p, phase) for p in peers if p is not w)
            excess = value - fastest
            if value <= 0 or typical / value >= opts.threshold:
                continue
            if value - typical < max(opts.min_cost * step, opts.min_excess_s):
                continue
            # "compute" only when no single phase stands out on its own.
            if phase == _COMPUTE and worst is not None:
                continue
            if excess > worst_excess:
                worst, worst_excess = (phase, fastest, value), excess
        return worst
