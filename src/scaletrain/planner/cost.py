"""The analytic core: `memory(...)` and `step_time(...)` of one layout, from the
model's profile and a hardware file.

Memory per device:

- Model states: bytes per parameter that data parallelism shards from a ZeRO stage
  on (`States`): the optimizer's state (and any fp32 master copy) from stage 1,
  gradients from 2, parameters from 3 (each strategy's stage: layout.STRATEGIES).
  Tensor parallel divides the parameters its plan shards, a pipeline stage holds
  its own layers'.
- Activations: the profile's peak at the per-device batch, less the share tensor
  parallel divides (what its attention and MLP modules hold; with sequence parallel,
  all that its blocks hold, plus the inputs its colwise layers gather whole and keep);
  a pipeline stage holds its share for every microbatch in
  flight (at most pp on the first stage with 1F1B, all of them with GPipe).
- Buffers: FSDP's gathered units in the compute dtype (a unit and the next with
  prefetch, at most the two largest; every unit at once where FSDP keeps them
  gathered, fsdp-keep), a pipeline's send and receive buffers.
- The peak is the larger of the backward's (activations and the gradients alive
  then) and the optimizer step's (every gradient and its temporaries).
- CPU offload (FSDP's): the shards of every state live in host memory (`Memory.host`,
  against `Host.memory`); the device holds the units in flight and activations.

Step time: a device's compute is its matmul FLOPs at the hardware's achieved
FLOP/s plus the bytes its other kernels move at its memory bandwidth, and no less
than its kernels' launches (`Hardware.launch` each: a GPU overlaps them with its
work, so it takes the larger of the two, a CPU their sum; compiled, see
COMPILED_BYTES). Communication is alpha-beta over the link each group spans
(hardware.Link); what overlaps with compute:

- DDP: gradient buckets all-reduce during the backward; the step waits for what
  outlasts the backward, and at least for the last bucket.
- FSDP: the next unit's all-gather runs during this unit's compute (prefetch); the
  first gather of each pass, what outlasts the compute and the last reduce-scatter
  are exposed.
  With CPU offload each unit's shard is copied in before its gather and its
  gradients' shard out after their reduce-scatter (`Host.bandwidth`), in the same
  stream, and the optimizer steps on the host (`Host.memory_bandwidth`), exposed.
- Tensor parallel: its collectives sit between a block's matmuls and are exposed, in
  the forward and the backward (and the forward's again where full checkpointing
  recomputes it). With sequence
  parallel each all-reduce becomes a reduce-scatter, and each colwise layer
  all-gathers its input.
- A pipeline's step is its schedule simulated (planner.schedule) with the sends
  between stages; its bubble is the step less the busiest rank's work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scaletrain.errors import ConfigError
from scaletrain.hardware import Hardware, Host, Link
from scaletrain.planner.layout import Layout
from scaletrain.planner.profile import ModelProfile, Work
from scaletrain.planner.schedule import simulate
from scaletrain.strategies.partition import Layer, split_layers

__all__ = [
    "COMPILED_BYTES",
    "COMPILED_KERNELS",
    "DDP_BUCKET",
    "Estimate",
    "Memory",
    "Model",
    "States",
    "StepTime",
    "estimate",
    "gathered",
    "memory",
    "model_states",
    "states_for",
    "step_time",
]

DDP_BUCKET = 25 * 2**20
"""PyTorch DDP's default bucket_cap_mb (25 MiB)."""
COMPILED_BYTES = 1 / 3
"""The bytes a compiled step moves against eager's: Inductor fuses a chain of
pointwise and reduction ops into one kernel that reads its inputs and writes its
outputs once, and the intermediates (about two thirds of an eager block's
elementwise traffic: each op writes a tensor the next reads again) never reach memory."""
COMPILED_KERNELS = 1 / 4
"""The kernels of a compiled step against eager's: a block's ~30 elementwise
kernels become a few fused ones."""
MULTI_TENSOR = 64
"""Tensors one launch of a foreach (multi-tensor) optimizer kernel covers on a GPU:
its per-parameter ops launch once per chunk of the parameter list."""
MASTER = {"32": 4.0, "bf16-mixed": 4.0, "fp16-mixed": 4.0, "bf16-true": 2.0}
"""Bytes per parameter of the weights a precision trains (mixed precision keeps fp32
weights and casts for the matmuls; bf16-true holds them in bf16)."""
COMPUTE = {"32": 4.0, "bf16-mixed": 2.0, "fp16-mixed": 2.0, "bf16-true": 2.0}
"""Bytes per parameter of the weights the matmuls read (what FSDP all-gathers under
its mixed-precision policy)."""
DTYPE = {"32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "bf16"}


def gathered(layout: Layout, precision: str) -> bool:
    """Whether `layout` runs a mixed precision as sharded FSDP does: the weights cast
    to the compute dtype as they are gathered, and no autocast, so its activations are
    all in the compute dtype (its model's profile is taken so: profile_model's
    `gathered`)."""
    return layout.dp > 1 and layout.stage >= 2 and MASTER[precision] > COMPUTE[precision]


@dataclass(frozen=True, slots=True)
class States:
    """Model states as (name, bytes per parameter, the ZeRO stage that shards it, and
    bytes per parameter of its shard once sharded: 0 for a state the sharded
    optimizer frees once reduced)."""

    parts: tuple[tuple[str, float, int] | tuple[str, float, int, float], ...]
    transient: dict[str, float] = field(default_factory=dict)
    """Bytes per parameter of the unit being computed held whole once its state is
    sharded: stage 3's gathered weights (and a DeepSpeed-style optimizer's
    low-precision gradients of that unit)."""


def states_for(precision: str, optimizer_per_param: float) -> States:
    """This package's training: weights and gradients at the precision's bytes (the
    gradients in the weights' dtype), the optimizer's state as measured. (FSDP's
    gathered units are buffers, counted by `memory`.)"""
    w = MASTER[precision]
    return States((("params", w, 3), ("grads", w, 2), ("optimizer", optimizer_per_param, 1)))


def model_states(
    params: float, shards: int, stage: int, states: States, largest: float = 0.0
) -> dict[str, float]:
    """Bytes per device of each state: `params` parameters over `shards` data-parallel
    ranks at ZeRO `stage`; `largest`: the parameters of the largest unit."""
    out: dict[str, float] = {}
    for name, per, sharded_from, *rest in states.parts:
        if stage < sharded_from:
            out[name] = per * params
        else:
            shard = rest[0] if rest else per
            out[name] = shard * params / shards + states.transient.get(name, 0.0) * largest
    return out


@dataclass(frozen=True, slots=True)
class Model:
    """What the formulas need of a model beyond its profile: its layers (for pipeline
    stages), the units FSDP shards, what tensor parallel divides and the blocks
    sequence parallel splits (none where it cannot)."""

    profile: ModelProfile
    layers: Sequence[Layer]
    units: Sequence[str]
    tp_plan: Mapping[str, str] | None = None
    compiled: bool = False
    precision: str = "32"
    sp_blocks: Sequence[str] = ()

    def _sum(self, names: Sequence[str], attr: str) -> float:
        mods = self.profile.modules
        return float(sum(getattr(mods[n], attr) for n in names if n in mods))

    def held_activations(self) -> int:
        """What the top-level layers (blocks in a ModuleList among them) leave alive for
        the backward, at the profile's batch; the root's children where it has none."""
        names = [m for x in self.layers for m in x.members] or [
            n for n in self.profile.modules if n and "." not in n
        ]
        return int(self._sum(names, "activation_bytes"))

    def tp_shares(self) -> tuple[float, float]:
        """Fractions of the parameters and FLOPs tensor parallel divides: its planned
        layers' parameters, and the FLOPs of the modules holding them (attention and
        MLP blocks: their heads and hidden width split)."""
        if not self.tp_plan:
            return 0.0, 0.0
        p = self.profile
        params = self._sum(list(self.tp_plan), "param_bytes") / max(1, p.param_bytes)
        flops = self._sum(self._holders(), "flops") / max(1.0, p.flops)
        return min(params, 1.0), min(flops, 1.0)

    def _holders(self) -> list[str]:
        return sorted({n.rpartition(".")[0] for n in self.tp_plan or {}})

    def tp_split(self, sp: bool = False) -> float:
        """Bytes of the peak (at the profile's batch) tensor parallel divides: what the
        modules holding its layers keep for the backward; with sequence parallel
        (`sp`), all that the blocks keep. The rest (embeddings, head, the loss's
        temporaries) is whole on every rank."""
        if not self.tp_plan:
            return 0.0
        return self._sum(list(self.sp_blocks) if sp else self._holders(), "activation_bytes")

    def tp_messages(self, sp: bool = False) -> tuple[int, int, float]:
        """Collectives per forward and the bytes of each: one per rowwise layer (its
        output all-reduced, or with sequence parallel reduce-scattered), and with
        sequence parallel one all-gather per colwise layer (TensorParallel gives each
        `input_layouts=Shard(1)`: each gathers its input whole). The backward runs the
        same collectives on the gradients."""
        if not self.tp_plan:
            return 0, 0, 0.0
        rows = [n for n, s in self.tp_plan.items() if s == "rowwise"]
        cols = sum(s == "colwise" for s in self.tp_plan.values()) if sp else 0
        return len(rows), cols, self._sum(rows, "output_bytes") / max(1, len(rows))

    def stages(self, pp: int) -> list[list[Layer]]:
        return split_layers(self.layers, pp)

    def stage_shares(self, pp: int) -> list[tuple[float, float, float]]:
        """Each stage's shares of (parameters, work, held activations); what sits
        outside the layers goes to the first stage's parameters and the last stage's
        work (the loss)."""
        members = [[m for x in s for m in x.members] for s in self.stages(pp)]
        par, work, acts = (
            [self._sum(ms, attr) for ms in members]
            for attr in ("param_bytes", "flops", "activation_bytes")
        )
        par[0] += max(0.0, self.profile.param_bytes - sum(par))
        work[-1] += max(0.0, self.profile.flops - sum(work))
        total = (max(1.0, sum(par)), max(1.0, sum(work)), max(1.0, sum(acts)))
        return [
            (a / total[0], b / total[1], c / total[2])
            for a, b, c in zip(par, work, acts, strict=True)
        ]

    def unit_params(self) -> list[float]:
        """Parameters (bytes at training precision) of each FSDP unit and of the root
        holding the rest."""
        own = [self._sum([u], "param_bytes") for u in self.units]
        rest = self.profile.param_bytes - sum(own)
        return [*own, rest] if rest > 0 else own


@dataclass(frozen=True, slots=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    grads_at_peak: float
    optimizer_temp: float
    host: float = 0.0
    """Bytes in host memory (CPU offload's shards)."""

    @property
    def total(self) -> float:
        states = self.params + self.optimizer + self.buffers
        return states + max(self.grads_at_peak + self.activations, self.grads + self.optimizer_temp)


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float
    comm: float
    """All communication of the step, hidden or not."""
    exposed: float
    bubble: float = 0.0
    floor: bool = False
    """True where kernel launches, not the work, set the compute time."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.bubble


@dataclass(frozen=True, slots=True)
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    notes: list[str] = field(default_factory=list)


def _local(model: Model, layout: Layout) -> tuple[float, float]:
    """(parameter, work) shares of the busiest device before data parallelism: what
    tensor parallel and a pipeline stage leave it."""
    tp_p, tp_f = model.tp_shares()
    cut = 1 - 1 / layout.tp
    par, work = 1 - tp_p * cut, 1 - tp_f * cut
    if layout.pp > 1:
        shares = model.stage_shares(layout.pp)
        par *= max(x[0] for x in shares)
        work *= max(x[1] for x in shares)
    return par, work


def memory(layout: Layout, model: Model, batch: int) -> Memory:
    """Bytes per device of `layout` at `batch` samples per data-parallel replica."""
    if layout.sp and not model.sp_blocks:
        raise ConfigError(
            f"the layout {layout.label} is sequence parallel, which needs the model's "
            "tensor-parallel layers inside blocks of one nn.ModuleList or nn.Sequential, "
            "and this model has none. Fix: plan the layout with sp=False.",
            field="layouts",
        )
    p, prec, pp, m = model.profile, model.precision, layout.pp, layout.microbatches or 1
    par, _ = _local(model, layout)
    psi = p.params * par
    units = [u / max(1e-9, p.param_bytes / max(1, p.params)) for u in model.unit_params()]
    states = states_for(prec, p.optimizer_bytes / max(1, p.params))
    s = model_states(psi, layout.dp, layout.stage, states, max(units or [0.0]) * par)
    buffers = 0.0
    if layout.dp > 1 and layout.stage == 3:  # a unit and the next, or every unit kept
        buffers = (sum(units) if layout.keeps else sum(sorted(units)[-2:])) * par * COMPUTE[prec]
    acts = p.activation_bytes * p.per_sample(batch / m)
    if layout.tp > 1:
        # What a module held after its forward counts its output too: at most the peak.
        acts -= min(acts, model.tp_split(layout.sp) * p.per_sample(batch / m)) * (1 - 1 / layout.tp)
        if layout.sp and not p.ac.startswith("full"):  # the gathered inputs, kept whole
            _, gathers, each = model.tp_messages(sp=True)
            acts += gathers * each * p.per_sample(batch / m)
    if pp > 1:
        shares = model.stage_shares(pp)
        inflight = [m if layout.schedule == "gpipe" else min(m, pp - r) for r in range(pp)]
        held = model.held_activations() * p.per_sample(batch / m)
        rest = max(0.0, acts - held)  # the loss's and the step's temporaries
        acts = max(
            shares[r][2] * held * inflight[r] + (rest if r == pp - 1 else 0.0) for r in range(pp)
        )
        edge = max(p.modules[s[-1].members[-1]].output_bytes for s in model.stages(pp)[:-1])
        buffers += 2 * edge * p.per_sample(batch / m)
    alive = p.peak_grad_bytes / max(1, p.param_bytes)
    at_peak = s["grads"] if (layout.dp > 1 and layout.stage == 0) else s["grads"] * min(1.0, alive)
    temp, host = p.optimizer_temp_bytes * par, 0.0
    if layout.offload:  # the states and the optimizer step move to the host
        host, temp, at_peak = sum(s.values()), 0.0, 0.0
        s = dict.fromkeys(s, 0.0)
    return Memory(
        params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=max(0.0, acts),
        buffers=buffers, grads_at_peak=at_peak, optimizer_temp=temp, host=host,
    )  # fmt: skip


def _seconds(work: Work, hw: Hardware, dtype: str, compiled: bool) -> tuple[float, bool]:
    """(seconds, launch-bound) of `work` on one device (module docstring)."""
    moved = work.bytes * (COMPILED_BYTES if compiled else 1.0)
    kernels = work.kernels * (COMPILED_KERNELS if compiled else 1.0)
    busy = work.flops / hw.matmul_flops(dtype) + moved / hw.memory_bandwidth
    launches = kernels * hw.launch
    if hw.device == "cpu":
        return busy + launches, False
    return max(busy, launches), launches > busy


def _link(hw: Hardware, inner: int) -> Link:
    """The link a group spans: inside a node while it and the dimensions inside it fit
    on one (tensor parallel innermost, then data parallel, then pipeline stages)."""
    return hw.intra if inner <= hw.devices_per_node else hw.inter


def _ddp(layout: Layout, model: Model, hw: Hardware, bwd_s: float) -> tuple[float, float]:
    """(communication, exposed) of DDP (module docstring)."""
    grads = model.profile.params * _local(model, layout)[0] * MASTER[model.precision]
    buckets = max(1, math.ceil(grads / DDP_BUCKET))
    each = _link(hw, layout.dp * layout.tp).time("all_reduce", grads / buckets, layout.dp)
    return each * buckets, max(each, each * buckets - bwd_s)


def _fsdp(
    layout: Layout, model: Model, hw: Hardware, fwd_s: float, bwd_s: float
) -> tuple[float, float]:
    """(communication, exposed) of FSDP (module docstring): each unit gathered in the
    compute dtype, again for the backward unless it keeps them."""
    prec, link, n = model.precision, _link(hw, layout.dp * layout.tp), layout.dp
    down = COMPUTE[prec] / MASTER[prec]
    par = _local(model, layout)[0]
    units = [u * par for u in model.unit_params()]
    host = _host(layout, hw)

    def copy(u: float) -> float:  # a unit's shard to or from the host
        return u / n / host.bandwidth if host else 0.0

    def gather_s(u: float) -> float:
        return link.time("all_gather", u * down, n) + copy(u)

    def scatter_s(u: float) -> float:
        return link.time("reduce_scatter", u, n) + copy(u)

    gather, scatter = sum(map(gather_s, units)), sum(map(scatter_s, units))
    again = 0.0 if layout.keeps else gather
    first, last = gather_s(units[0]), scatter_s(units[-1])
    return gather + again + scatter, first + max(0.0, gather - fwd_s) + max(
        last, again + scatter - bwd_s
    )


def _host(layout: Layout, hw: Hardware) -> Host | None:
    """The host `layout` offloads to (None: it does not offload)."""
    if layout.offload and hw.host is None:
        raise ConfigError(
            f"the layout {layout.label} offloads to the host, and {hw.name}'s hardware file "
            "has no [host] table. Fix: add one (memory, bandwidth, memory_bandwidth), or "
            "plan the layout without offload.",
            field="hardware",
        )
    return hw.host if layout.offload else None


def _tensor(layout: Layout, model: Model, hw: Hardware, batch: int, share: float) -> float:
    """Seconds of tensor parallel's collectives (`Model.tp_messages`, module docstring)."""
    p, link, n = model.profile, _link(hw, layout.tp), layout.tp
    rows, gathers, each = model.tp_messages(layout.sp)
    each *= p.per_sample(batch) * share
    if layout.sp:
        one = rows * link.time("reduce_scatter", each, n) + gathers * link.time(
            "all_gather", each, n
        )
    else:
        one = rows * link.time("all_reduce", each, n)
    return one * (3 if p.ac.startswith("full") else 2)


def _pipeline(
    layout: Layout, model: Model, hw: Hardware, batch: int, fwd_s: float, bwd_s: float, share: float
) -> tuple[float, float, float]:
    """(the busiest rank's work, communication, bubble) of a pipeline: its schedule
    simulated with each stage's share of the work per microbatch, and the sends."""
    p, m = model.profile, layout.microbatches or 1
    shares = model.stage_shares(layout.pp)
    virtual = 2 if layout.schedule == "interleaved-1f1b" else 1
    per_f, per_b = fwd_s / share / m, bwd_s / share / m  # the whole model, one microbatch
    f = [per_f * x[1] / virtual for x in shares for _ in range(virtual)]
    b = [per_b * x[1] / virtual for x in shares for _ in range(virtual)]
    edge = max(p.modules[s[-1].members[-1]].output_bytes for s in model.stages(layout.pp)[:-1])
    hop = _link(hw, layout.devices).time("send", edge * p.per_sample(batch / m), 2)
    tl = simulate(
        f, b, schedule=layout.schedule or "1f1b", microbatches=m, virtual=virtual, hop=hop
    )
    busiest = max(tl.work)
    return busiest, hop * 2 * m * (layout.pp - 1), max(0.0, tl.makespan - busiest)


def step_time(layout: Layout, model: Model, hw: Hardware, batch: int) -> StepTime:
    """Seconds of one step of `layout` at `batch` samples per replica on `hw`: the
    device's own work, then each parallelism's communication (the functions above)."""
    p, prec, compiled = model.profile, model.precision, model.compiled
    dtype = DTYPE[prec]
    par, share = _local(model, layout)
    # Every tensor-parallel rank launches every kernel of its stage: only a pipeline
    # stage has fewer of them.
    launches = max(x[1] for x in model.stage_shares(layout.pp)) if layout.pp > 1 else 1.0
    fixed = p.fixed.scaled(share / 2, launches / 2)  # half in each pass
    scale = p.per_sample(batch) * share
    fwd_s, fwd_floor = _seconds(p.forward.scaled(scale, launches) + fixed, hw, dtype, compiled)
    bwd_s, bwd_floor = _seconds(p.backward.scaled(scale, launches) + fixed, hw, dtype, compiled)
    opt_work = p.optimizer.scaled(par / (layout.dp if layout.stage >= 1 else 1))
    if hw.device == "cuda":  # foreach kernels: one launch per op and chunk of tensors
        per_tensor = p.optimizer.kernels / max(1, p.tensors)
        chunks = math.ceil(p.tensors * par / MULTI_TENSOR)
        opt_work = Work(0.0, opt_work.bytes, math.ceil(per_tensor * chunks))
    opt_s, _ = _seconds(opt_work, hw, "fp32", False)
    if host := _host(layout, hw):  # the host's kernels: bound by its memory, no launches
        opt_s = p.optimizer.bytes * par / layout.dp / host.memory_bandwidth
    work, comm, exposed, bubble = fwd_s + bwd_s, 0.0, 0.0, 0.0
    if layout.dp > 1:
        comm, exposed = (
            _ddp(layout, model, hw, bwd_s)
            if layout.stage == 0
            else _fsdp(layout, model, hw, fwd_s, bwd_s)
        )
    if layout.tp > 1:
        tp = _tensor(layout, model, hw, batch, share)
        comm, exposed = comm + tp, exposed + tp
    if layout.pp > 1:
        work, sends, bubble = _pipeline(layout, model, hw, batch, fwd_s, bwd_s, share)
        comm += sends
    return StepTime(
        compute=work + opt_s, comm=comm, exposed=exposed, bubble=bubble,
        floor=fwd_floor and bwd_floor,
    )  # fmt: skip


def estimate(layout: Layout, model: Model, hw: Hardware, batch: int) -> Estimate:
    """One row of a plan: `layout`'s memory and step time, and whether it fits."""
    mem, time = memory(layout, model, batch), step_time(layout, model, hw, batch)
    host = _host(layout, hw)
    fits = mem.total <= hw.memory and (host is None or mem.host <= host.memory)
    notes = []
    if mem.total > hw.memory:
        over = (mem.total - hw.memory) / 2**30
        notes.append(f"does not fit: {over:.2f} GiB over {hw.memory / 2**30:.1f} GiB")
    if host:
        full = f", over its {host.memory / 2**30:.1f} GiB" if mem.host > host.memory else ""
        held = f"{mem.host / 2**30:.1f} GiB" if mem.host >= 2**30 else f"{mem.host / 2**20:.1f} MiB"
        notes.append(f"{held} of states in host memory per device{full}")
    if layout.sp:
        notes.append("sequence parallel: st.TensorParallel(sequence_parallel=True), from Python")
    if time.floor:
        notes.append("kernel launches, not the arithmetic, set this step's pace")
    return Estimate(layout, mem, time, fits, notes)
