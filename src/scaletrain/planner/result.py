"""A plan as data and as a table: every layout's row, the fastest that fits
recommended and why, the assumptions it was made on (`Plan`, which `plan` in api.py
returns)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.errors import spell
from scaletrain.hardware import Hardware
from scaletrain.planner.cost import DTYPE, Estimate
from scaletrain.planner.profile import ModelProfile

__all__ = ["Plan", "count", "recommend"]


@dataclass(slots=True)
class Plan:
    """Every layout of `devices` for one model: rows, the recommended one and why."""

    model: str
    devices: int
    nodes: int
    hardware: Hardware
    precision: str
    batch_size: int
    profile: ModelProfile
    rows: list[Estimate]
    recommended: Estimate | None
    reason: str
    assumptions: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Layouts of the devices not planned, each with the reason."""
    float8: bool = False
    """Whether the blocks' Linear layers train in float8."""
    accumulate: int = 1
    """Micro-steps of `batch_size` samples per replica in each step (gradient
    accumulation)."""

    def row(self, label: str) -> Estimate:
        """The row of a layout's label ("fsdp dp=8") or strategy ("fsdp": its first)."""
        for r in self.rows:
            if r.layout.label == label or r.layout.strategy == label:
                return r
        raise KeyError(
            f"no row {label!r}; the rows: {', '.join(r.layout.label for r in self.rows)}"
        )

    def throughput(self, row: Estimate) -> float:
        """Samples per second of the whole job (every replica takes `batch_size` in each
        of `accumulate` micro-steps)."""
        samples = self.batch_size * self.accumulate * row.layout.dp
        return samples / max(row.time.total, 1e-12)

    def tokens_per_device(self, row: Estimate) -> float:
        """Tokens (samples for a model without a sequence) per second per device."""
        per = self.profile.tokens / self.profile.batch_size
        return self.throughput(row) * per / row.layout.devices

    def mfu(self, row: Estimate) -> float | None:
        """The step's FLOPs over the datasheet peak, as the ledger's MFU counts them."""
        peak = self.hardware.peak_flops.get(DTYPE[self.precision])
        if not peak:
            return None
        flops = self.profile.model_flops * self.batch_size / self.profile.batch_size
        flops *= self.accumulate
        return flops * row.layout.dp / row.time.total / (peak * row.layout.devices)

    def planned(self) -> str:
        """What was planned: the model and its size, the devices, the hardware file, the
        precision, the batch and the checkpointing (the table's first line says it)."""
        prof = self.profile
        tokens = prof.tokens != prof.batch_size
        seq = f", {prof.tokens // prof.batch_size:,} tokens a sample" if tokens else ""
        return (
            f"{self.model} ({count(prof.params)} parameters{seq}) on {self.devices} "
            f"device(s), {self.nodes} node(s) of {self.hardware.name} "
            f"({self.hardware.description}); precision {self.precision}"
            f"{', float8' if self.float8 else ''}, batch "
            f"{self.batch_size} per replica"
            f"{f' x {self.accumulate} micro-steps' if self.accumulate > 1 else ''}, "
            f"activation checkpointing {prof.ac}"
        )

    def table(self) -> str:
        """The plan as `scaletrain plan` prints it: what was planned, a row per layout
        (within 120 columns for the layouts a plan makes of up to thousands of devices),
        the notes, the recommendation and the assumptions."""
        big = max((r.memory.total for r in self.rows), default=0) > 16 * 2**30
        unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
        tokens = self.profile.tokens != self.profile.batch_size
        rate = "tok/s/dev" if tokens else "samples/s/dev"
        rates = [f"{self.tokens_per_device(r):,.0f}" for r in self.rows]
        wide = max([len(rate), *map(len, rates)])
        name = max([len("layout"), *(len(r.layout.label) + 1 for r in self.rows)])
        sizes = " ".join(f"{c:>6}" for c in ("params", "grads", "optim", "acts", "bufs", "peak"))
        times = " ".join(f"{c:>6}" for c in ("step", "comm", "bubble"))
        head = f"{'layout':<{name}} {'fits':<4} {sizes} {times} {rate:>{wide}} {'mfu':>4}"
        lines = [
            f"{self.planned()}; memory in {unit} per device, time in ms per step, of which "
            "comm (the communication not hidden) and bubble; * the recommended row",
            head,
            "-" * len(head),
        ]
        # A note every row has (launch-bound steps, mostly) is said once, after them.
        common = [n for n in self.rows[0].notes if all(n in r.notes for r in self.rows[1:])]
        common = common if len(self.rows) > 1 else []
        for r, speed in zip(self.rows, rates, strict=True):
            m, t, mfu = r.memory, r.time, self.mfu(r)
            parts = (m.params, m.grads, m.optimizer, m.activations, m.buffers, m.total)
            sizes = " ".join(_figure(v / scale, 6) for v in parts)
            times = " ".join(_figure(v * 1e3, 6) for v in (t.total, t.exposed, t.bubble))
            lines.append(
                f"{r.layout.label + ('*' if r is self.recommended else ''):<{name}} "
                f"{'yes' if r.fits else 'NO':<4} {sizes} {times} {speed:>{wide}} "
                f"{'' if mfu is None else ' <1%' if 0 < mfu < 0.005 else f'{mfu:4.0%}'}".rstrip()
            )
            lines.extend(f"    {n}" for n in r.notes if n not in common)
        lines.extend(f"every row: {n}" for n in common)
        lines.extend(f"not planned: {s}" for s in self.skipped)
        lines.append(f"recommended: {self.reason}")
        lines.extend(f"assumption: {a}" for a in self.assumptions)
        return "\n".join(lines)


def _figure(value: float, width: int) -> str:
    """`value` right-aligned in `width` characters: one decimal where it fits."""
    shown = f"{value:.1f}"
    return f"{shown if len(shown) <= width else f'{value:.0f}':>{width}}"


def count(n: int) -> str:
    """1,235.8M, 3.2B, 5,130: a parameter count as people say it."""
    if n >= 10**9:
        return f"{n / 1e9:,.1f}B"
    return f"{n / 1e6:,.1f}M" if n >= 10**6 else f"{n:,}"


def recommend(plan: Plan, checkpoints: bool) -> tuple[Estimate | None, str]:
    """The fastest row that fits, the smallest peak among those of the same time (within
    half a percent: what the reason's ratio shows as 1.00x). CPU offload only where
    nothing fits without it: it trades the step's time for device memory. Where nothing
    fits, the fixes that apply (`checkpoints`: the model has blocks to checkpoint)."""
    fitting = [r for r in plan.rows if r.fits]
    fitting = [r for r in fitting if not r.layout.offload] or fitting
    fitting.sort(key=lambda r: (-plan.throughput(r), r.memory.total))
    if not fitting:
        fixes = [
            "more devices",
            f"a smaller {spell('batch_size')} (and {spell('accumulate')} for the same global "
            "batch)" if plan.batch_size > 1 else "",
            spell("ac", "full") if checkpoints and not plan.profile.ac.startswith("full") else "",
            spell("precision", "bf16-mixed") if plan.precision == "32" else "",
            "a hardware file with a [host] table (FSDP's CPU offload)"
            if plan.hardware.host is None and plan.devices > 1 else "",
        ]  # fmt: skip
        *most, last = [f for f in fixes if f]
        return None, (
            "nothing fits: every layout overflows a device (the rows marked NO). Fix: "
            + ", ".join(most)
            + (", or " if most else "")
            + last
        )
    top = plan.throughput(fitting[0])
    same = [r for r in fitting if plan.throughput(r) * 1.005 >= top]
    best = min(same, key=lambda r: r.memory.total)
    unit = "tokens" if plan.profile.tokens != plan.profile.batch_size else "samples"
    rate = f"{plan.tokens_per_device(best):,.0f} {unit}/s per device"
    why = f"{best.layout.label}: the highest throughput that fits, {rate}"
    if other := next((r for r in fitting if r is not best), None):
        ratio = plan.throughput(best) / max(plan.throughput(other), 1e-12)
        less = f"{ratio:.2f}" == "1.00" and best.memory.total < other.memory.total
        why += (
            f", {ratio:.2f}x {other.layout.label}{' (the same time, less memory)' if less else ''}"
        )
    return best, why
