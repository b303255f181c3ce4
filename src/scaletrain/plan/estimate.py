"""Memory per device and step time of one layout, from a ModelProfile and a machine.

Memory per device (bytes): parameters, gradients and optimizer state divided as the
layout shards them; activations at the batch (a pipeline stage holds the microbatches
its schedule keeps in flight: 1F1B at most pp on the first stage, GPipe all M); and
communication buffers (FSDP's all-gathered units, tensor parallel's all-reduced
activations, a pipeline's send/receive buffers). `growth` is what training adds once
the model is set up (what `plan --check` compares with a run's RSS growth): DDP's
gradients live in its buckets from setup on, everything else appears in the steps.
On this machine an FSDP row's growth is at least what the probe measured of the
model's sharded steps: the allocator keeps memory FSDP frees, beyond any model of it.

Step time: compute (measured seconds per sample and per optimizer step, scaled by the
share of FLOPs and parameters each device holds), exposed communication (alpha-beta
collectives, less the overlap with the backward) and, for a pipeline, the bubble. A
pipeline's step is its schedule simulated (plan/schedule.py): each stage's forward
and backward of a microbatch are the model's at the microbatch size times the
stage's measured share (its FLOPs' on a profile), the sends are the hops between
stages (on this machine, where the probe timed a stage's at the row's group size, as
it did: comm.CommModel.stage_hop),
and on this machine the stages share the cores. Its compute is the busiest
rank's time at work, its bubble the rest of the step; for equal stages each on a
device of its own that is the textbook (pp-1)/M of a stage's work (over the virtual
stages for interleaved 1F1B). Other rows: on a CPU with more processes than cores,
the processes take turns: compute is multiplied by processes/cores. On this machine
the probe's measurements add what ranks sharing it cost each other: compute grows by
their contention (comm.Concurrency; an FSDP or tensor-parallel row's work is the
probe's own measurement of its step among the ranks, comm.CommModel.step_cpu, where it
has one), a pipeline stage pays each send and receive's CPU
(comm.CommModel.send_cpu), and the step waits for the slowest rank (in a pipeline, as
far as another stage's work can outlast the busiest's: comm.Concurrency.sync) and, at
each blocking collective not timed from work by the probe (comm.CommModel.busy), for a
core (comm.CommModel.meeting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise

from scaletrain.plan.comm import CommModel
from scaletrain.plan.costs import Compute, Estimate, Memory, StepTime
from scaletrain.plan.hardware import Hardware, Link
from scaletrain.plan.layertime import LOSS
from scaletrain.plan.layouts import Layout
from scaletrain.plan.profile import ModelProfile
from scaletrain.plan.schedule import simulate
from scaletrain.strategies.partition import Layer, balance_stages

__all__ = [
    "DDP_BUCKET_BYTES",
    "Compute",
    "Estimate",
    "Memory",
    "StepTime",
    "estimate",
    "send_bytes",
    "step_collectives",
]

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default bucket_cap_mb (25 MiB)."""


@dataclass(frozen=True, slots=True)
class _Piped:
    stages: list[list[Layer]]
    """The model cut into pp stages (by parameters, as the pipeline strategy cuts it)."""
    send: float
    """Seconds of one microbatch's send between two stages."""
    send_cpu: float
    """CPU seconds a send or a receive costs the stage's process (this machine's)."""
    param_shares: list[float]


def _stage_shares(
    profile: ModelProfile, compute: Compute, stages: Sequence[Sequence[Layer]]
) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward as fractions of the model's forward+backward:
    its layers' measured shares (the loss on the last stage), else its FLOPs (a
    backward twice its forward; what runs outside the layers on the last stage)."""
    names = [layer.name for stage in stages for layer in stage]
    shares = compute.layer_shares
    if shares and all(n in shares for n in names):
        f = [sum(shares[layer.name][0] for layer in stage) for stage in stages]
        b = [sum(shares[layer.name][1] for layer in stage) for stage in stages]
        loss_f, loss_b = shares.get(LOSS, (0.0, 0.0))
    else:
        flops = [
            float(_sum(profile, [n for x in stage for n in x.members], "flops")) for stage in stages
        ]
        total = max(1.0, float(profile.flops), sum(flops))
        f = [x / total / 3 for x in flops]
        b = [2 * x / total / 3 for x in flops]
        rest = max(0.0, 1 - sum(flops) / total)
        loss_f, loss_b = rest / 3, 2 * rest / 3
    f[-1] += loss_f
    b[-1] += loss_b
    whole = max(1e-12, sum(f) + sum(b))
    return [x / whole for x in f], [x / whole for x in b]


def _pipeline_time(
    layout: Layout,
    profile: ModelProfile,
    layers: Sequence[Layer],
    compute: Compute,
    piped: _Piped,
    hw: Hardware,
    contention: float,
    background: float,
) -> tuple[float, float, float, float, list[float]]:
    """(compute, bubble, slowdown, exposed sends) of a pipeline's busiest rank, and each
    rank's work over the busiest's (one per device: a stage's tensor-parallel ranks and
    replicas alike), from its schedule simulated (scaletrain.plan.schedule): each
    stage's forward and backward of a microbatch are the whole model's at the
    microbatch size times the stage's share, plus its share of the pipeline's
    machinery; the optimizer and the runtime's step run after the schedule.
    Interleaved 1F1B cuts pp x 2 stages (refused, as the strategy refuses it, where the
    model has fewer layers)."""
    pp, m = layout.pp, layout.microbatches or 1
    virtual = 2 if layout.schedule == "interleaved-1f1b" else 1
    if len(layers) < pp * virtual:
        # As the pipeline strategy refuses it (Pipeline.check_layout, split_points).
        raise ValueError(
            f"{layout.label}: interleaving needs {pp * virtual} stages, 2 per rank, but the "
            f"model has {len(layers)} layers to cut; use schedule '1f1b'"
        )
    stages = _stages(layers, pp * virtual) if virtual > 1 else piped.stages
    fshare, bshare = _stage_shares(profile, compute, stages)
    # Per microbatch: the model's forward+backward and the traced graph's machinery
    # (measured for the whole model as one stage over m microbatches).
    unit = (
        compute.fwd_bwd(profile.batch_size / m) + compute.overhead.get("pipeline", 0.0) / m
    ) * contention
    # A stage receives and sends each microbatch's activations and their gradients at
    # each boundary it has (the ends one, the rest two).
    ends = [(s > 0) + (s < len(stages) - 1) for s in range(len(stages))]
    forward = [unit * x + piped.send_cpu * e for x, e in zip(fshare, ends, strict=True)]
    backward = [unit * x + piped.send_cpu * e for x, e in zip(bshare, ends, strict=True)]
    params = (
        piped.param_shares
        if virtual == 1
        else [sum(piped.param_shares) / pp] * pp  # interleaved: about even per rank
    )
    # After the schedule: the optimizer, the runtime's step and, over data-parallel
    # replicas, DDP's reducer for the rank's share of the model.
    reducer = compute.overhead.get("ddp", 0.0) if layout.dp > 1 else 0.0
    tail = [
        ((compute.optimizer + reducer) * params[r] + compute.overhead.get("step", 0.0)) * contention
        for r in range(pp)
    ]
    run = partial(
        simulate, forward, backward, schedule=layout.schedule or "1f1b", microbatches=m,
        virtual=virtual, cores=hw.cores, replicas=layout.dp, background=background, tail=tail,
    )  # fmt: skip
    quiet, sent = run(), run(hop=piped.send)
    r = max(range(pp), key=lambda i: quiet.work[i])
    busy = quiet.running[r]
    top = max(quiet.work[r], 1e-12)
    return (
        busy,
        quiet.makespan - busy,
        busy / top,
        max(0.0, sent.makespan - quiet.makespan),
        [w / top for w in quiet.work] * (layout.dp * layout.tp),
    )


def send_bytes(layout: Layout, profile: ModelProfile, layers: Sequence[Layer]) -> float:
    """Bytes of a pipeline's largest send: a microbatch's activations at a stage boundary
    (0 without stages)."""
    if layout.pp <= 1:
        return 0.0
    stages = _stages(layers, layout.pp)
    boundary = max(profile.modules[s[-1].members[-1]].output_bytes for s in stages[:-1])
    return boundary / (layout.microbatches or 1)


def _broadcast(comm: CommModel, nbytes: float, n: int, link: Link | None, *, here: bool) -> float:
    """Seconds of a broadcast of `nbytes` from one rank to n - 1 others. On this machine
    a send to each in turn (Gloo's small broadcasts: 0.2 ms at 2 processes, 0.8-1.2 at
    4, where a gather of the same bytes took 0.3-0.6 and 3.6-3.8); on a profile a
    pipelined ring (NCCL's): the bytes once, a message's latency per hop."""
    if n <= 1:
        return 0.0
    if here:
        return (n - 1) * comm.time("send", nbytes, 2, link)
    return comm.time("send", nbytes, 2, link) + (n - 2) * comm.time("send", 1, 2, link)


def _stages(layers: Sequence[Layer], pp: int) -> list[list[Layer]]:
    cuts = [0, *balance_stages([max(1, layer.size) for layer in layers], pp), len(layers)]
    return [list(layers[a:b]) for a, b in pairwise(cuts)]


def _sum(profile: ModelProfile, names: Sequence[str], attr: str) -> int:
    return sum(getattr(profile.modules[n], attr) for n in names if n in profile.modules)


def _tp_parts(profile: ModelProfile, tp_plan: Mapping[str, str]) -> dict[str, int]:
    """Bytes and FLOPs tensor parallel divides, and what it all-reduces per step."""
    parents = sorted({n.rpartition(".")[0] for n in tp_plan})
    rowwise = [n for n, s in tp_plan.items() if s == "rowwise"]
    colwise = [n for n, s in tp_plan.items() if s == "colwise"]
    replicated_out = _sum(profile, rowwise, "output_bytes")
    return {
        "params": _sum(profile, list(tp_plan), "param_bytes"),
        "flops": _sum(profile, parents, "flops"),
        "acts": max(0, _sum(profile, parents, "activation_bytes") - replicated_out),
        "fwd_bytes": replicated_out,
        "fwd_msgs": len(rowwise),
        "bwd_bytes": _sum(profile, colwise, "input_bytes"),
        "bwd_msgs": len(colwise),
        "largest": max([profile.modules[n].output_bytes for n in rowwise if n in profile.modules] or [0]),
    }  # fmt: skip


def _fsdp_units(
    profile: ModelProfile, layers: Sequence[Layer], names: Sequence[str] | None, frac: float
) -> list[tuple[float, int]]:
    """(parameter bytes, all-gathers per step) of each unit FSDP shards: the modules the
    strategy wraps (`names`), each gathered for its forward and again for its backward
    and reduce-scattered once, and the root holding the rest, gathered once (FSDP keeps
    the root's parameters from its forward to its backward). Without `names`, each of
    the planner's layers and the root, as the probe's fully sharded steps wrap them.
    The gpt recipe's 4 blocks and root make 9 all-gathers and 5 reduce-scatters a step
    (counted in a run); priced as its 8 layers, 16 and 8."""
    if names is None:
        names = [layer.name for layer in layers]
    own = [profile.modules[n].param_bytes for n in names if n in profile.modules]
    units = [(b * frac, 2) for b in own]
    rest = profile.param_bytes - sum(own)
    if rest > 0:
        units.append((rest * frac, 1))
    return units


def step_collectives(
    profile: ModelProfile,
    layers: Sequence[Layer],
    tp_plan: Mapping[str, str] | None,
    fsdp_units: Sequence[str] | None,
) -> dict[str, list[tuple[str, int]]]:
    """(kind, bytes) of each collective a rank makes in a step over the whole group,
    for "fsdp" (each unit's gathers and reduction) and "tensor" (a rowwise layer's
    output in the forward, a colwise one's input gradient in the backward: the same at
    every degree, each rank holding the whole tensor)."""
    out: dict[str, list[tuple[str, int]]] = {"fsdp": []}
    for u, gathers in _fsdp_units(profile, layers, fsdp_units, 1.0):
        out["fsdp"] += [("all_gather", int(u))] * gathers + [("reduce_scatter", int(u))]
    if tp_plan:
        parts = _tp_parts(profile, tp_plan)
        out["tensor"] = []
        for way in ("fwd", "bwd"):
            if parts[f"{way}_msgs"]:
                each = parts[f"{way}_bytes"] // parts[f"{way}_msgs"]
                out["tensor"] += [("all_reduce", each)] * parts[f"{way}_msgs"]
    return out


def estimate(
    layout: Layout,
    profile: ModelProfile,
    *,
    layers: Sequence[Layer],
    tp_plan: Mapping[str, str] | None,
    compute: Compute,
    comm: CommModel,
    hw: Hardware,
    overlap: float,
    nodes: int = 1,
    fsdp_units: Sequence[str] | None = None,
) -> Estimate:
    """One row of the plan: `layout` for `profile` on `hw` (see the module docstring).
    `fsdp_units`: the modules the fsdp strategy shards as units, by name (default: each
    of `layers`, and the root)."""
    P, G, Opt, A = (
        profile.param_bytes + profile.buffer_bytes,
        profile.grad_bytes,
        profile.optimizer_bytes,
        profile.activation_bytes,
    )
    B = profile.batch_size
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    frac_p = frac_f = 1.0  # share of parameters / FLOPs on the busiest device
    acts, buffers, comm_s, exposed_free = float(A), 0.0, 0.0, 0.0
    meetings = 0  # blocking collectives per step on the busiest rank, priced quiet
    here = hw.cores is not None

    def reached(kind: str, nbytes: float, n: int, link: Link | None, count: int = 1) -> float:
        """Seconds of `count` blocking collectives the ranks come to from their work: as
        the probe timed them so on this machine (CommModel.busy, over all the layout's
        ranks, within a node), else quiet, each then a meeting (its cost beyond quiet,
        comm.CommModel.meeting)."""
        nonlocal meetings
        # Timed at the probe's size, all of this layout's ranks (a smaller group among
        # them meets another crowd).
        timed = here and link is None and n == layout.devices
        busy = comm.busy.get((kind, n)) if timed else None
        if busy is None:
            meetings += count
        return count * comm.time(kind, nbytes, n, busy or link)

    samples = float(B)
    per_node = max(1, layout.devices // max(1, nodes))
    inner = hw.inter if tp > per_node else None
    if tp > 1 and tp_plan:
        parts = _tp_parts(profile, tp_plan)
        frac_p = 1.0 - parts["params"] / P * (1 - 1 / tp)
        frac_f = 1.0 - parts["flops"] / max(1, profile.flops) * (1 - 1 / tp)
        acts = A - parts["acts"] * (1 - 1 / tp)
        buffers += parts["largest"]
        for way in ("fwd", "bwd"):  # on the critical path
            msgs = parts[f"{way}_msgs"]
            exposed_free += reached("all_reduce", parts[f"{way}_bytes"] / max(1, msgs), tp,
                                    inner, msgs)  # fmt: skip
    m = layout.microbatches or 1
    piped: _Piped | None = None
    stage_buffers: list[int] = []
    if pp > 1:
        stages = _stages(layers, pp)
        members = [[n for layer in s for n in layer.members] for s in stages]
        act = [_sum(profile, ms, "activation_bytes") for ms in members]
        stage_params = [_sum(profile, ms, "param_bytes") for ms in members]
        stage_buffers = [_sum(profile, ms, "buffer_bytes") for ms in members]
        frac_p *= max(stage_params) / max(1, sum(stage_params))
        # Microbatches whose activations a stage holds at once: GPipe all M; 1F1B
        # stage s at most pp - s (the first stage the most). The busiest stage counts.
        in_flight = [
            act[i] * (m if layout.schedule == "gpipe" else min(m, pp - i)) / m for i in range(pp)
        ]
        acts = acts * max(in_flight) / max(1, sum(act))
        sent = send_bytes(layout, profile, layers)
        buffers += 2 * sent
        # Between nodes the inter-node link; else, where measured here at this group size,
        # a hop as a stage makes it (the sender goes on with its work, the others
        # compute: comm.CommModel.stage_hop; a ddp x pp row's two pipelines meet the same
        # crowd of ranks); else a send's link.
        link = (
            hw.inter
            if pp * tp > per_node
            else (comm.stage_hop.get(layout.devices) if hw.cores is not None else None)
        )
        send = comm.time("send", sent, 2, link)
        # The sends are the simulated schedule's hops: a stage waits at a receive for
        # the data (posted ahead, they are no meeting of busy ranks: counted as one,
        # they read the pipelines 17-26% long here).
        piped = _Piped(
            stages=stages,
            send=send,
            send_cpu=comm.send_cpu.get(layout.devices, 0.0) if hw.cores is not None else 0.0,
            param_shares=[x / max(1, sum(stage_params)) for x in stage_params],
        )
        # Every step ends in the pipeline strategy's broadcast of the loss from the last
        # stage (a scalar: its latency). No meeting of busy ranks: the first rank ends
        # its schedule last by construction (its last backward needs every later
        # stage's), so the others wait in the broadcast, the loss already sent, and the
        # cores are free. Counted as one, with the slowest of 2 equal stages, the convnet
        # recipe's 2-stage pipeline read 0.7-1.0 ms of waiting where its first stage
        # waited 0.2-0.3 (its CPU 9.8-10.2 ms in steps of 10.1-10.4).
        exposed_free += _broadcast(
            comm, 8, pp, hw.inter if pp * tp > per_node else None, here=hw.cores is not None
        )
    params, grads, opt = P * frac_p, G * frac_p, Opt * frac_p
    if layout.strategy in ("fsdp", "fsdp x tp") and dp > 1:
        units = _fsdp_units(profile, layers, fsdp_units, frac_p) or [
            (profile.param_bytes * frac_p, 1)  # all of it the root's
        ]
        outer = hw.inter if layout.devices > per_node else None
        comm_s += sum(
            reached("all_gather", u, dp, outer, gathers) + reached("reduce_scatter", u, dp, outer)
            for u, gathers in units
        )
        top = sorted((u for u, _ in units), reverse=True)
        buffers += sum(top[:2]) + top[0]
        params, grads, opt = params / dp, grads / dp, opt / dp
    elif dp > 1:
        outer = hw.inter if layout.devices > per_node else None
        n_buckets = max(1, -(-int(grads) // DDP_BUCKET_BYTES))
        comm_s += reached("all_reduce", grads / n_buckets, dp, outer, n_buckets)
        # A ddp x pp stage's DDP holds (and broadcasts) its own stage's buffers only;
        # those of no layer (registered on the model itself) counted with the largest.
        held = (
            max(stage_buffers) + max(0, profile.buffer_bytes - sum(stage_buffers))
            if pp > 1 and stage_buffers
            else profile.buffer_bytes
        )
        if held:
            # DDP broadcasts the buffers (BatchNorm's running statistics) from rank 0 at
            # every forward (its broadcast_buffers, on by default): a collective before
            # the forward. The ConvNet's runs at 2 processes took 1.2-2 ms a step longer
            # with it than without.
            exposed_free += _broadcast(comm, held, dp, outer, here=hw.cores is not None)
            meetings += 1
        if hw.cores is not None:
            # Gloo (this CPU machine) reduces a bucket through working buffers of about
            # its size, allocated at the first backward, after setup: the gpt recipe's
            # runs grew 2.6 MiB more at 2 processes than at 1 (3.3 MiB of gradients).
            buffers += grads / n_buckets
    fwd_bwd = compute.fwd_bwd(samples) * frac_f
    work = fwd_bwd + compute.optimizer * frac_p / (dp if layout.strategy.startswith("fsdp") else 1)
    # Each rank runs every op of its part, however small its shard: the machinery's
    # cost per step is not divided by the degree.
    work += compute.overhead.get("step", 0.0)
    if tp > 1 and tp_plan:
        work += compute.overhead.get("tensor", 0.0)
    if layout.strategy in ("fsdp", "fsdp x tp") and dp > 1:
        work += compute.overhead.get("fsdp", 0.0)
    if layout.strategy == "ddp" and dp > 1:
        work += compute.overhead.get("ddp", 0.0)  # its reducer's hooks and buckets
    # Ranks stepping side by side on this machine's cores slow each other (shared
    # caches and memory bandwidth: more CPU per step), and every rank waits for the
    # slowest at each step's collectives (both measured by the probe, given the step).
    side = comm.concurrency.get(layout.devices) if hw.cores is not None else None
    contention = side.factor if side is not None else 1.0
    crowded = comm.step_cpu.get((layout.strategy, layout.devices)) if here else None
    if crowded is not None and (tp_plan or layout.strategy != "tensor"):
        # Measured by the probe with every rank stepping (crowd.step_growth): DTensor's
        # dispatch and FSDP's copies run on caches left cold at every collective,
        # which neither the count above nor plain steps' contention sees. The seconds
        # themselves, not x the plain step's measured alone over the calibration's:
        # each of those is a process's draw of the allocator (the convnet recipe's
        # FSDP step at 2 ranks took 14.3-14.8 ms in 4 probes, 1.47-1.82x their plain
        # step alone). At another batch, scaled as the calibration's step scales.
        base = compute.line(samples) + compute.optimizer
        at = compute.line(comm.batch) + compute.optimizer if comm.batch else base
        work = crowded * (base / at if at > 0 else 1.0) + compute.overhead.get("step", 0.0)
        contention = 1.0
    background = compute.background(hw.cores) if hw.cores is not None else 0.0
    bubble = hidden = 0.0
    weights: list[float] | None = None  # each rank's work over the busiest's
    if piped is not None:
        work, bubble, slowdown, sends, weights = _pipeline_time(
            layout, profile, layers, compute, piped, hw, contention, background
        )
        exposed_free += sends
        hidden = max(0.0, 2 * m * piped.send - sends)
    else:
        work *= contention
        slowdown = 1.0
        if hw.cores is not None:
            # Every rank wants a core, and so do other programs (their load inferred from
            # the calibration's share of a core): the ranks get cores / (load + ranks) each.
            slowdown = max(1.0, (background + layout.devices) / hw.cores)
        work *= slowdown
    # The busiest rank waits for another only where that one's work can outlast its own
    # (a pipeline's lighter stages rarely do: Concurrency.sync's weights).
    wait = (work + bubble) * (side.sync(layout.devices, weights) - 1) if side is not None else 0.0
    if hw.cores is not None:
        # Waiting, not CPU: a collective's threads wait for a core, its ranks arrive apart.
        wait += meetings * comm.meeting.get(layout.devices, 0.0)
    exposed = comm_s * (1 - overlap) + exposed_free
    memory = Memory(
        params=int(params),
        grads=int(grads),
        optimizer=int(opt),
        activations=int(acts),
        buffers=int(buffers),
        runtime=compute.runtime_bytes + (compute.trace_bytes if pp > 1 else 0),
        grads_at_setup=layout.strategy in ("ddp", "ddp x pp") and dp > 1,
        group=comm.runtime_bytes.get(layout.devices, 0),
    )
    # A 1F1B stage with more microbatches than stages runs forwards after its first
    # backward: its gradients exist from then on, at every later activation peak.
    steady = pp > 1 and layout.schedule != "gpipe" and m > pp
    if hw.cores is None and not memory.grads_at_setup and profile.grad_bytes and not steady:
        # A GPU's peak: the activations and the gradients alive with them (measured by
        # the profile's tracker), not every gradient (the gpt recipe at 1B parameters,
        # bf16-mixed on an H200: 26,752 MiB peak allocated, where counting every
        # gradient predicted 30,405 and this 26,553).
        alive = min(1.0, profile.peak_grad_bytes / profile.grad_bytes)
        memory = replace(memory, reused=int(min(memory.activations, grads * (1 - alive))))
    # FSDP's and tensor parallel's steps over all the ranks, where the probe measured
    # the RSS they add (crowd.step_growth): at least that.
    grown = comm.step_growth.get((layout.strategy, layout.devices)) if here else None
    if layout.strategy in ("fsdp", "tensor") and layout.devices > 1 and grown is not None:
        memory = replace(memory, held=max(0, grown - memory.growth))
    fits = memory.total <= hw.device_memory
    overflow = None
    if not fits:
        where = "the busiest stage's devices" if pp > 1 else "every device"
        over = (memory.total - hw.device_memory) / 2**30
        overflow = f"{where}: {over:.2f} GiB over {hw.device_memory / 2**30:.1f} GiB"
    return Estimate(
        layout=layout,
        memory=memory,
        time=StepTime(
            compute=work,
            comm=comm_s + exposed_free + hidden,
            exposed=exposed,
            bubble=bubble,
            slowdown=slowdown,
            wait=wait,
        ),
        fits=fits,
        overflow=overflow,
    )
