"""The analytic core: `memory` and `step_time` of one layout, from the model's
profile (profile.py, with what structure.py adds of it) and a hardware file.

Memory per device:

- Model states (`States`): data parallelism shards the optimizer's state (and any fp32
  master copy) from ZeRO stage 1 on, gradients from 2, parameters from 3 (each
  strategy's stage: layout.STRATEGIES). Frozen parameters have no gradient to hold or
  reduce. Tensor parallel divides the parameters its plan shards, a pipeline stage
  holds its own layers' (and the gradients and state of those it trains); a
  pipeline's peak is its fullest stage's.
- Activations: the profile's peak at the per-device batch, less what tensor parallel
  divides (what its attention and MLP modules hold, less their rowwise outputs; with
  sequence parallel all its blocks hold, plus what it holds whole: the inputs its
  colwise layers gather and keep, those of the blocks not checkpointed and of the one
  block being recomputed, and under selective checkpointing the rowwise outputs kept
  before their reduce-scatter; under checkpointing also one block's recomputation). A
  pipeline stage holds its share for each microbatch in flight (at most pp with 1F1B,
  all with GPipe).
- Buffers: FSDP's gathered units in the compute dtype, float8 training's weights in
  float8 (FSDP's float8 all-gather); a unit and the next, at most the two largest;
  every unit where it keeps them gathered (fsdp-keep); a pipeline's send and receive
  buffers.
- The peak is the larger of the backward's (activations and the gradients alive then)
  and the optimizer step's (every gradient and its temporaries). With FSDP's CPU
  offload the states' shards live in host memory (`Memory.host`).

Step time: matmul FLOPs at the hardware's achieved FLOP/s (float8 training's at its
fp8 figure, those autocast leaves in float32 at its fp32 one) plus the bytes the
other kernels move at its memory bandwidth, and no less than their launches
(`Hardware.launch` each: a GPU overlaps them with its work, a CPU adds them; compiled,
see COMPILED_BYTES). Communication is alpha-beta over the
link each group spans (hardware.Link), exposed where it outlasts what hides it:

- DDP: gradient buckets all-reduce during the backward; at least the last is exposed.
- FSDP: the next unit's all-gather runs during this unit's compute (prefetch); the
  first gather of each pass, what outlasts the compute and the last reduce-scatter are
  exposed. With CPU offload each shard is copied in before its gather and out after
  its reduce-scatter (`Host.bandwidth`), and the optimizer steps on the host, exposed:
  its memory's pace (`Host.memory_bandwidth`) and a dispatch per op (`launch`).
- Tensor parallel: its collectives sit between a block's matmuls, exposed: a rowwise
  layer's output all-reduced in the forward, the gradient of each input the colwise
  layers take (once for q, k and v, which share it) in the backward, and what a
  checkpointed block's recomputation runs again. Sequence parallel makes each
  all-reduce a reduce-scatter and all-gathers each colwise input and each rowwise
  layer's output gradient (in float8 for float8 training's layers).
- Pipeline: its schedule simulated (schedule.py) with the sends between stages; what
  the sends add to the simulated step is exposed communication, the bubble what the
  step without them has beyond the busiest rank's work.
- Gradient accumulation (K micro-steps a step): each micro-step's work, tensor
  parallel's and a pipeline's collectives and FSDP's gathers K times, the gradients
  reduced once, in the last (DDP's no_sync; FSDP keeps them whole until then, which
  its memory counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scaletrain.hardware import Hardware, Link
from scaletrain.planner.kernels import Work
from scaletrain.planner.layout import Layout
from scaletrain.planner.schedule import simulate
from scaletrain.planner.structure import COMPUTE, DTYPE, MASTER, Model, Share

__all__ = ["COMPILED_BYTES", "COMPILED_KERNELS", "DDP_BUCKET", "DTYPE", "Estimate", "Memory",
           "States", "StepTime", "estimate", "gathered", "memory", "model_states", "step_time",
           "tp_collectives"]  # fmt: skip

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
"""Tensors one launch of a foreach (multi-tensor) optimizer kernel covers on a GPU."""


def gathered(layout: Layout, precision: str) -> bool:
    """Whether `layout` runs a mixed precision as sharded FSDP does: the weights cast to
    the compute dtype as they are gathered, no autocast, every activation in the compute
    dtype (its profile is taken so: profile_model's `gathered`)."""
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
    """One row of a plan: a layout's memory per device (bytes; `memory.total` is its
    peak), its step time (seconds; `time.total`), whether it fits, and notes."""

    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    notes: list[str] = field(default_factory=list)


def _devices(model: Model, layout: Layout) -> list[Share]:
    """What the device of each pipeline stage (the one stage without a pipeline) holds
    before data parallelism: its stage's shares, less what tensor parallel divides."""
    tp, cut = model.tp_shares(), 1 - 1 / layout.tp
    return [
        Share(s.params * (1 - tp.params * cut), s.trained * (1 - tp.trained * cut),
              s.work * (1 - tp.work * cut), s.acts)
        for s in model.stage_shares(layout.pp)
    ]  # fmt: skip


def _local(model: Model, layout: Layout) -> Share:
    """The busiest device's shares: of each, the most a stage's device holds (the
    slowest stage sets the step's pace)."""
    return Share(*map(max, zip(*_devices(model, layout), strict=True)))


def memory(layout: Layout, model: Model, batch: int, accumulate: int = 1) -> Memory:
    """Bytes per device of `layout` at `batch` samples per data-parallel replica and
    micro-step (`accumulate` of them a step): of the pipeline stage whose device's peak
    is the highest (a stage holds its own layers' parameters, the gradients and
    optimizer state of those it trains, and its activations)."""
    p, prec, pp, m = model.profile, model.precision, layout.pp, layout.microbatches or 1
    per = p.per_sample(batch / m)
    units = [u / max(1e-9, p.param_bytes / max(1, p.params)) for u in model.unit_params()]
    w = MASTER[prec]  # gradients in the weights' dtype; a frozen parameter has none
    adam = p.optimizer_bytes / max(1, p.trainable)  # per trained parameter
    acts, at_head = p.activation_bytes * per, 0.0
    if layout.tp > 1:
        # What a module held after its forward counts its output too: at most the peak.
        # A rank peaks where the profile does, or before the backward reaches the blocks
        # (ModelProfile.head_activation_bytes), when what it divides is small beside the
        # logits; with sequence parallel each also holds some whole (`_sp_held`).
        one = model.tp_messages(sp=True)[2] * per if layout.sp else 0.0  # a whole activation
        at_head = p.head_activation_bytes * per
        at_head -= min(at_head, model.tp_split(layout.sp, False) * per) * (1 - 1 / layout.tp)
        at_head += _sp_held(model, False) * one
        acts -= min(acts, model.tp_split(layout.sp) * per) * (1 - 1 / layout.tp)
        acts += _sp_held(model) * one
    inflight = [m if layout.schedule == "gpipe" else min(m, pp - r) for r in range(pp)]
    held = model.held_activations() * per if pp > 1 else acts
    rest = max(0.0, acts - held)  # a pipeline's last stage: the loss's and step's temporaries
    sends = 2 * model.edge(pp) * per if pp > 1 else 0.0
    alive, alive_head = (min(1.0, g / max(1, p.trainable_bytes))
                         for g in (p.peak_grad_bytes, p.head_grad_bytes))  # fmt: skip
    rows = []
    for r, share in enumerate(_devices(model, layout)):
        psi = p.params * share.params
        each = p.trainable * share.trained / max(1e-9, psi)  # of a parameter, trained
        states = States((("params", w, 3), ("grads", w * each, 2), ("optimizer", adam * each, 1)))
        s = model_states(psi, layout.dp, layout.stage, states, max(units or [0.0]) * share.params)
        buffers = sends
        if layout.dp > 1 and layout.stage == 3:  # a unit and the next, or every unit kept
            whole = [u * f * w for u, f in zip(units, model.gathered(), strict=True)]
            buffers += (sum(whole) if layout.keeps else sum(sorted(whole)[-2:])) * share.params
        mine = share.acts * held * (inflight[r] if pp > 1 else 1) + (rest if r == pp - 1 else 0.0)
        ddp = layout.dp > 1 and layout.stage == 0  # its gradient buckets live all along
        at_peak = s["grads"] if ddp else s["grads"] * alive
        head_grads = s["grads"] if ddp else s["grads"] * alive_head
        if layout.tp > 1 and pp == 1 and at_head + head_grads > mine + at_peak:
            mine, at_peak = at_head, head_grads
        temp, host = p.optimizer_temp_bytes * share.trained, 0.0
        if layout.offload:  # the states and the optimizer step move to the host
            host, temp, at_peak = sum(s.values()), 0.0, 0.0
            s = dict.fromkeys(s, 0.0)
        if accumulate > 1 and layout.dp > 1 and layout.stage >= 2:
            # Accumulating, FSDP keeps each gradient whole (in its reduce dtype, the
            # weights') until the last micro-step reduce-scatters the sum.
            at_peak = max(at_peak, psi * each * w)
        rows.append(Memory(
            params=s["params"], grads=s["grads"], optimizer=s["optimizer"],
            activations=max(0.0, mine), buffers=buffers, grads_at_peak=at_peak,
            optimizer_temp=temp, host=host,
        ))  # fmt: skip
    return max(rows, key=lambda x: x.total)


def _sp_held(model: Model, recomputing: bool = True) -> float:
    """Whole activations sequence parallel holds beyond what it splits, in activations
    of the profile's dtype. Each gathered input, kept for its weights' gradient (in
    float8, a byte, where float8 training converts its layer): every one the
    recomputation does not run, and of those it runs one block's at a time (the
    all-gather is not an op checkpointing keeps: the recomputation gathers again;
    `recomputing` False: none, before the backward reaches the blocks). Under op-level
    selective checkpointing, each recomputed rowwise layer's output, kept whole before
    its reduce-scatter (a matmul's output: the policy keeps it)."""
    names = model.gatherers()
    again = {n for n, r in zip(names, model.recompute(names), strict=True) if r}
    size = {n: 1 / COMPUTE[model.precision] if model.in_float8(n) else 1.0 for n in names}
    block = max((sum(size[n] for n in again if n.startswith(f"{u}.")) for u in model.units),
                default=0.0) if recomputing else 0.0  # fmt: skip
    gathered = sum(size[n] for n in names if n not in again) + block
    rows = model.recompute(model.styled("rowwise"))
    kept = sum(map(bool, rows)) if model.profile.ac == "selective" else 0
    return gathered + kept


def _seconds(work: Work, hw: Hardware, dtype: str, compiled: bool) -> tuple[float, bool]:
    """(seconds, launch-bound) of `work` on one device (module docstring)."""
    # Compiled, float8's casts fuse to their own measure (Work.fused), the rest by
    # COMPILED_BYTES.
    moved = (work.bytes - work.casts) * COMPILED_BYTES + work.fused if compiled else work.bytes
    matmuls = (work.flops - work.fp8 - work.fp32) / hw.matmul_flops(dtype)
    matmuls += work.fp32 / hw.matmul_flops("fp32") + work.fp8 / hw.matmul_flops("fp8")
    busy = matmuls + moved / hw.memory_bandwidth
    launches = work.kernels * (COMPILED_KERNELS if compiled else 1.0) * hw.launch
    if hw.device == "cpu":
        return busy + launches, False
    return max(busy, launches), launches > busy


def _link(hw: Hardware, inner: int) -> Link:
    """The link a group spans: inside a node while it and the dimensions inside it fit
    on one (tensor parallel innermost, then data parallel, then pipeline stages)."""
    return hw.intra if inner <= hw.devices_per_node else hw.inter


def _ddp(layout: Layout, model: Model, hw: Hardware, bwd_s: float) -> tuple[float, float]:
    """(communication, exposed) of DDP (module docstring)."""
    p = model.profile
    grads = p.trainable * _local(model, layout).trained * MASTER[model.precision]
    buckets = max(1, math.ceil(grads / DDP_BUCKET))
    each = _link(hw, layout.dp * layout.tp).time("all_reduce", grads / buckets, layout.dp)
    return each * buckets, max(each, each * buckets - bwd_s)


def _fsdp(
    layout: Layout, model: Model, hw: Hardware, fwd_s: float, bwd_s: float, accumulate: int
) -> tuple[float, float]:
    """(communication, exposed) of FSDP (module docstring): each unit gathered in the
    compute dtype (float8 layers' weights in float8), again for the backward unless it
    keeps them, in each of `accumulate` micro-steps; reduced in the last."""
    link, n = _link(hw, layout.dp * layout.tp), layout.dp
    host = hw.host if layout.offload else None
    local = _local(model, layout)
    units = [u * local.params for u in model.unit_params()]
    grads = [g * local.trained for g in model.unit_params(trained=True)]  # reduced, copied out

    def copy(shard: float) -> float:  # a shard to or from the host
        return shard / n / host.bandwidth if host else 0.0

    pairs = zip(units, model.gathered(), strict=True)
    gathers = [link.time("all_gather", u * f, n) + copy(u) for u, f in pairs]
    scatters = [link.time("reduce_scatter", g, n) + copy(g) for g in grads]
    gather, scatter = sum(gathers), sum(scatters)
    again = 0.0 if layout.keeps else gather
    forward = gathers[0] + max(0.0, gather - fwd_s)
    exposed = forward + max(scatters[-1], again + scatter - bwd_s)
    exposed += (accumulate - 1) * (forward + max(0.0, again - bwd_s))  # reducing nothing
    return accumulate * (gather + again) + scatter, exposed


def tp_collectives(layout: Layout, model: Model) -> dict[str, int]:
    """Tensor parallel's collectives in one forward and backward, by kind, each of a
    whole activation (batch x tokens x width). Plain: a rowwise layer's partial output
    all-reduced in the forward, each colwise input's gradient in the backward (one for
    the layers that share it: Model.gatherers). Sequence parallel: the rowwise outputs
    reduce-scattered and the colwise inputs gathered ("all_gather", in float8 for
    float8 training's layers), the backward the mirror of each; and "edges", the
    sequence's gathers as it leaves the blocks (the forward's) and enters them (the
    backward's, of its gradient). Checkpointing's recomputation runs again what it
    runs (ModuleCost.recompute, measured by the profile): each input it gathers, and
    each rowwise output's collective it runs through (torch.utils.checkpoint stops
    once the backward has every tensor it saves: in a pre-norm block, inside the last
    rowwise layer), but the reduce-scatters op-level selective checkpointing keeps."""
    rows, cols, _ = model.tp_messages(layout.sp)
    through = sum(r == 2 for r in model.recompute(model.styled("rowwise")))
    if not layout.sp:
        return {"all_reduce": rows + cols + through}
    kept = model.profile.ac == "selective"
    return {
        "reduce_scatter": rows + cols + (0 if kept else through),
        "all_gather": cols + rows + sum(map(bool, model.recompute(model.gatherers()))),
        "edges": 2 if rows or cols else 0,
    }


def _tensor(layout: Layout, model: Model, hw: Hardware, batch: int) -> float:
    """Seconds of tensor parallel's collectives (`tp_collectives`), however small the
    share of the work each rank does: each moves the whole activation."""
    link, n = _link(hw, layout.tp), layout.tp
    each = model.tp_messages(layout.sp)[2] * model.profile.per_sample(batch)
    # float8's styles gather in float8 (1 byte) what a float8 layer gathers: a colwise
    # layer's input in the forward (and again in a recomputation), a rowwise layer's
    # output gradient in the backward; the reduce-scatters stay in the compute dtype.
    count = tp_collectives(layout, model)
    cols = model.gatherers()
    f8 = sum(map(model.in_float8, model.styled("rowwise") + cols)) + sum(
        model.in_float8(c) for c, r in zip(cols, model.recompute(cols), strict=True) if r
    ) if layout.sp else 0  # fmt: skip
    return (
        count.get("all_reduce", 0) * link.time("all_reduce", each, n)
        + count.get("reduce_scatter", 0) * link.time("reduce_scatter", each, n)
        + (count.get("all_gather", 0) - f8) * link.time("all_gather", each, n)
        + f8 * link.time("all_gather", each / COMPUTE[model.precision], n)
        + count.get("edges", 0) * link.time("all_gather", each, n)
    )


def _pipeline(
    layout: Layout, model: Model, hw: Hardware, batch: int, fwd_s: float, bwd_s: float, share: float
) -> tuple[float, float, float, float]:
    """(the busiest rank's work, communication, exposed, bubble) of a pipeline: its
    schedule simulated with each stage's share of the work per microbatch and the
    sends; exposed is what the sends add to the step, the bubble what it has without
    them."""
    m, virtual = layout.microbatches or 1, 2 if layout.schedule == "interleaved-1f1b" else 1
    shares = model.stage_shares(layout.pp)
    per_f, per_b = fwd_s / share / m, bwd_s / share / m  # the whole model, one microbatch
    f = [per_f * x.work / virtual for x in shares for _ in range(virtual)]
    b = [per_b * x.work / virtual for x in shares for _ in range(virtual)]
    edge = model.edge(layout.pp) * model.profile.per_sample(batch / m)
    hop = _link(hw, layout.devices).time("send", edge, 2)
    schedule = layout.schedule or "1f1b"
    tl = simulate(f, b, schedule=schedule, microbatches=m, virtual=virtual, hop=hop)
    idle = simulate(f, b, schedule=schedule, microbatches=m, virtual=virtual).makespan
    busiest = max(tl.work)
    sends = max(0.0, tl.makespan - idle)
    # Each microbatch crosses every boundary between the pp x virtual stages both ways.
    crossings = 2 * m * (layout.pp * virtual - 1)
    return busiest, hop * crossings, sends, max(0.0, idle - busiest)


def step_time(
    layout: Layout, model: Model, hw: Hardware, batch: int, accumulate: int = 1
) -> StepTime:
    """Seconds of one step of `layout` at `batch` samples per replica and micro-step on
    `hw`: the device's own work in each of `accumulate` micro-steps, then each
    parallelism's communication (the functions above; data parallelism reduces the
    gradients once, in the last micro-step), and the optimizer's step."""
    p, dtype, compiled = model.profile, DTYPE[model.precision], model.compiled
    local = _local(model, layout)
    share, trained = local.work, local.trained  # the optimizer steps the trained parameters
    # Every tensor-parallel rank launches every kernel of its stage: only a pipeline
    # stage has fewer of them.
    launches = max(x.work for x in model.stage_shares(layout.pp))
    fixed = p.fixed.scaled(share / 2, launches / 2)  # half in each pass
    scale = p.per_sample(batch) * share
    fwd_s, fwd_floor = _seconds(p.forward.scaled(scale, launches) + fixed, hw, dtype, compiled)
    bwd_s, bwd_floor = _seconds(p.backward.scaled(scale, launches) + fixed, hw, dtype, compiled)
    opt_work = p.optimizer.scaled(trained / (layout.dp if layout.stage >= 1 else 1))
    if hw.device == "cuda":  # foreach kernels: one launch per op and chunk of tensors
        per_tensor = p.optimizer.kernels / max(1, p.tensors)
        chunks = p.tensors * trained / MULTI_TENSOR
        opt_work = Work(0.0, opt_work.bytes, math.ceil(per_tensor * math.ceil(chunks)))
    opt_s, _ = _seconds(opt_work, hw, "fp32", False)
    if layout.offload and (host := hw.host):
        # PyTorch's CPU optimizer runs op by op, tensor by tensor (foreach is a GPU's):
        # its memory's pace plus a dispatch per op, priced as a kernel's launch.
        opt_s = p.optimizer.bytes * trained / layout.dp / host.memory_bandwidth
        opt_s += p.optimizer.kernels * trained * hw.launch
    work, comm, exposed, bubble = fwd_s + bwd_s, 0.0, 0.0, 0.0
    if layout.tp > 1:
        tp = _tensor(layout, model, hw, batch)
        comm, exposed = comm + tp, exposed + tp
    if layout.pp > 1:
        work, sends, waited, bubble = _pipeline(layout, model, hw, batch, fwd_s, bwd_s, share)
        comm, exposed = comm + sends, exposed + waited
    k = accumulate  # each micro-step's own work and collectives, then the step's
    work, comm, exposed, bubble = k * work, k * comm, k * exposed, k * bubble
    if layout.dp > 1:
        dp = _fsdp(layout, model, hw, fwd_s, bwd_s, k) if layout.stage else _ddp(
            layout, model, hw, bwd_s)  # fmt: skip
        comm, exposed = comm + dp[0], exposed + dp[1]
    return StepTime(work + opt_s, comm, exposed, bubble, floor=fwd_floor and bwd_floor)


def _size(nbytes: float) -> str:
    """2.34 GiB, 136.0 MiB: bytes as the table shows them (GiB from 1 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def estimate(
    layout: Layout, model: Model, hw: Hardware, batch: int, accumulate: int = 1
) -> Estimate:
    """One row of a plan: `layout`'s memory and step time, and whether it fits."""
    mem = memory(layout, model, batch, accumulate)
    time = step_time(layout, model, hw, batch, accumulate)
    host = hw.host if layout.offload else None
    notes = []
    # A CPU machine's memory is its node's, shared by the processes on it; a GPU's
    # allocator holds `reserve` beyond the peak the step allocates (Hardware.reserve).
    sharing = min(layout.devices, hw.devices_per_node) if hw.device == "cpu" else 1
    needed = mem.total * sharing * (1 + hw.reserve)
    if needed > hw.memory:
        over, of = _size(needed - hw.memory), _size(hw.memory)
        each = f" ({sharing} processes of {_size(mem.total)})" if sharing > 1 else ""
        held = f" (the peak and the allocator's {hw.reserve:.0%} over it)" if hw.reserve else ""
        notes.append(f"does not fit: {over} more than the device's {of}{each}{held}")
    if host:
        full = f", over its {_size(host.memory)}" if mem.host > host.memory else ""
        notes.append(f"{_size(mem.host)} of states in host memory per device{full}")
    if layout.pp > 1 and model.blocks_in_one_stage(layout.pp):
        # Stages are whole top-level layers (as the pipeline strategy cuts them): a model
        # whose blocks sit inside one of them (a Hugging Face model's `model`) is not split.
        names = ", ".join(m for x in model.layers for m in x.members)
        top = max(x.params for x in model.stage_shares(layout.pp))
        notes.append(
            f"one stage holds {top:.0%} of the parameters: stages are whole top-level layers "
            f"({names}), and this model's blocks sit inside one of them"
        )
    p = model.profile
    if (f32 := (p.forward.fp32 + p.backward.fp32) / max(1.0, p.flops)) >= 0.01:
        notes.append(
            f"{f32:.0%} of the matmul FLOPs run in float32: ops autocast does not cast (a "
            "mixture of experts' torch._grouped_mm); bf16-true and sharded FSDP run them in bf16"
        )
    if layout.sp:
        notes.append("sequence parallel: st.TensorParallel(sequence_parallel=True), from Python")
    if time.floor:
        notes.append("kernel launches, not the arithmetic, set this step's compute time")
    fits = needed <= hw.memory and (host is None or mem.host <= host.memory)
    return Estimate(layout, mem, time, fits, notes)
