"""What one row of a plan is made of: the model's measured compute, a device's memory
and a step's time, and the row (scaletrain.plan.estimate computes them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scaletrain.plan.hardware import Hardware
from scaletrain.plan.layouts import Layout
from scaletrain.plan.profile import ModelProfile

__all__ = ["Compute", "Estimate", "Memory", "StepTime"]


@dataclass(frozen=True, slots=True)
class Compute:
    """Seconds of one device's forward+backward (fixed + per sample) and optimizer step,
    for the whole model on one device: CPU seconds on this machine (what a rank needs
    of a core), device seconds for a profile."""

    fixed: float
    per_sample: float
    optimizer: float
    source: str
    share: float = 1.0
    """Fraction of a core the calibration got (CPU time / wall time): below 1 when the
    machine was busy with other work, whose load the estimate then accounts for."""
    load: float | None = None
    """The machine's 1-minute load average when calibrated (None: not measured)."""
    measured_growth: int | None = None
    """RSS the calibration's real steps added in a fresh process (bytes)."""
    runtime_bytes: int = 0
    """What the runtime adds beyond the model's tensors in a fresh process (the first
    step's kernel workspaces, allocator and autograd state): measured growth less the
    profile's prediction for one device."""
    trace_bytes: int = 0
    """RSS a pipeline rank's trace of the model adds after setup (plan/overhead.py)."""
    layer_shares: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Each layer's forward and backward as fractions of the model's forward+backward,
    measured at a pipeline's microbatch (plan/layertime.py; the loss under LOSS):
    what a pipeline's stages take of it. Empty: split by FLOPs."""
    scale: float = 1.0
    """The factor the model's step timed alone was scaled by to the training loop's own
    (the runtime's whole step less its measured overhead; 1.0 where not measured)."""
    overhead: Mapping[str, float] = field(default_factory=dict)
    """CPU seconds per step a rank spends beyond the model's own work, measured:
    "step", the training runtime's step around it (every row); "ddp", DDP's reducer;
    "tensor", DTensor's dispatch; "fsdp", its hooks; "pipeline", the traced graph and
    the schedule, for the whole model as one stage (plan/overhead.py)."""
    levels: Mapping[int, float] = field(default_factory=dict)
    """Forward+backward seconds at these sample counts (a pipeline's microbatches), where
    `fwd_bwd` gives them instead of the line: on this CPU machine the calibration's own
    time, not scaled to the training loop's at the batch. That loop runs slow or fast by
    where its process's allocations fall, and the microbatch's step does not follow it:
    the convnet recipe's loop at 32 samples ran 0.84-1.44x the calibration's timed step
    in 8 fresh processes, and the same processes' step at the microbatch of 8 took
    2.0-2.2 ms in all 8. Scaled, the microbatch read 1.7-3.0 ms and the pipeline's row
    11.2-16.0 ms, its runs 11.1-11.7; unscaled, the row read 11.5-12.4 in 5 fresh plans."""

    def fwd_bwd(self, samples: float) -> float:
        if samples == int(samples) and int(samples) in self.levels:
            return self.levels[int(samples)]
        return self.line(samples)

    def line(self, samples: float) -> float:
        """Forward+backward seconds at `samples` from the fit alone (no `levels`)."""
        return self.fixed + self.per_sample * samples

    def background(self, cores: int) -> float:
        """Runnable threads of other programs (a CPU machine shared with others), from
        the calibration's share s of a core: one thread among B others on `cores`
        cores gets cores / (B + 1) of one, so B = cores / s - 1 (0 when it got a whole
        core). Not from the load average: it trails the last minute, and after a busy
        minute (the last job's ranks) it counted ranks that were gone, which predicted
        a quiet box's 1-process gpt step 40% too slow."""
        return max(0.0, cores / self.share - 1) if self.share < 0.95 else 0.0

    @classmethod
    def fit(
        cls,
        points: Mapping[int, float],
        optimizer: float,
        source: str,
        *,
        share: float = 1.0,
        load: float | None = None,
        measured_growth: int | None = None,
    ) -> Compute:
        """From measured forward+backward seconds at two or more sample counts."""
        xs = sorted(points)
        if len(xs) == 1:
            return cls(0.0, points[xs[0]] / xs[0], optimizer, source, share, load, measured_growth)
        lo, hi = xs[0], xs[-1]
        per = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        fixed = max(0.0, points[hi] - per * hi)
        return cls(fixed, per, optimizer, source, share, load, measured_growth)

    @classmethod
    def from_flops(cls, profile: ModelProfile, hw: Hardware, precision: str) -> Compute:
        rate = hw.peak_flops[precision] * hw.compute_efficiency
        return cls(0.0, profile.flops / profile.batch_size / rate, 0.0, hw.name)


@dataclass(frozen=True, slots=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    runtime: int = 0
    """This machine's runtime overhead per process (measured; 0 for a profile, whose
    device memory already leaves room for the CUDA context)."""
    grads_at_setup: bool = False
    """DDP: gradients are views of buckets allocated when the model is wrapped."""
    group: int = 0
    """The process group's own memory (Gloo's transport, measured by the probe): in the
    total, not in `growth`. A run's first collective (DDP's or FSDP's broadcast at
    setup) allocates it before its growth is measured: on this machine a run of 2 or 4
    processes grew 0-3 MiB more than one of 1, for both recipes, where the probe
    measures 20-35 MiB."""
    held: int = 0
    """Freed memory the allocator keeps beyond the growth modelled above: FSDP and tensor
    parallel on this machine, where the probe measured the model's steps of that
    strategy (crowd.step_growth); 0 elsewhere."""
    reused: int = 0
    """Gradients that are not alive at the activations' peak, so not in the step's
    peak (GPUs: the caching allocator's peak is of live tensors, and the backward
    frees activations as it makes gradients; the optimizer's moment, with every
    gradient and no activation, is lower whenever this is counted). 0 on this CPU
    machine, whose RSS keeps what was freed, and for DDP, whose gradients live in its
    buckets from setup."""

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.optimizer + self.activations + self.buffers
            + self.runtime + self.group + self.held - self.reused
        )  # fmt: skip

    @property
    def growth(self) -> int:
        """Bytes training adds after setup (parameters, and DDP's buckets, exist before)."""
        grads = 0 if self.grads_at_setup else self.grads
        return (
            grads + self.optimizer + self.activations + self.buffers + self.runtime + self.held
            - self.reused
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float
    comm: float
    """All communication of the step, hidden or not."""
    exposed: float
    """The part of `comm` the step waits for."""
    bubble: float
    slowdown: float = 1.0
    """Compute and bubble are multiplied by this: ranks and other programs sharing
    this machine's cores (1 for a profile)."""
    wait: float = 0.0
    """Waiting on this machine (0 for a profile): for the slowest rank (steps vary, and
    synchronous ranks meet at every step), and at each blocking collective for its
    threads to get a core (comm.CommModel.meeting)."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.bubble + self.wait

    @property
    def cpu(self) -> float:
        """CPU seconds a rank spends per step on this machine: its compute without the
        waiting for a core, plus the communication (Gloo's copies and reductions)."""
        return self.compute / self.slowdown + self.exposed


@dataclass(frozen=True, slots=True)
class Estimate:
    layout: Layout
    memory: Memory
    """The busiest device's (the first pipeline stage's for a pipeline)."""
    time: StepTime
    fits: bool
    overflow: str | None
    """Which device overflows and by how much, when the row does not fit."""
