"""`st.plan`: a recipe (or any model) planned on this machine or on paper.

The estimates themselves are scaletrain.plan (pure functions of the model and the
machine); this module knows recipes, the tensor-parallel plan the TensorParallel
strategy would use, and the training runtime's own step, which it calibrates.
Checking a finished run against its plan: scaletrain.train.checking.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, spell
from scaletrain.plan.api import Plan, check_request, plan_model
from scaletrain.plan.comm import CommModel
from scaletrain.plan.estimate import Compute
from scaletrain.plan.layouts import Layout, layouts_for
from scaletrain.precision import canonical
from scaletrain.strategies.partition import list_layers

__all__ = [
    "CALIBRATIONS",
    "Check",
    "RuntimeCost",
    "calibrated",
    "check_run",
    "fsdp_units_of",
    "layout_of",
    "measured",
    "measured_allocated",
    "measured_cpu",
    "plan",
    "resolve_model",
    "runtime_overhead",
    "tp_plan_of",
]


def resolve_model(
    recipe: str | None, model: str | Callable[[], nn.Module] | None
) -> tuple[str, Callable[[], nn.Module], Callable[[int], Any], Any, Callable[[Any], Any], int]:
    """(name, build, example, loss, optimizer factory, default batch) for a recipe or
    a model given as "module:factory" (scaletrain.train.recipes's protocol; the
    example batch is the module's example(batch_size), else its first training
    samples)."""
    from scaletrain.train.recipes import get_recipe

    if recipe is not None and model is not None:
        raise ConfigError(
            f"{spell('recipe', recipe)} and {spell('model', model)} both name the model. "
            f"Fix: give one of them.",
            field="model",
        )
    if model is None:
        r = get_recipe(recipe or "convnet")
        # Picklable (no lambdas): the probe's processes build the model's step.
        return r.name, r.build, r.example, r.loss, partial(r.optimizer, lr=r.lr), r.batch_size
    if callable(model):
        raise ConfigError(
            f"{spell('model', model)}: give the model as 'module:factory' (the protocol "
            "`scaletrain train --model` reads: scaletrain.train.recipes), so that the "
            "planner's processes can import it.",
            field="model",
        )
    from scaletrain.train.recipes import check_recipe, load_recipe

    r = load_recipe(str(model))
    check_recipe(r, training=False)
    return r.spec or r.name, r.build, r.example, r.loss, partial(r.optimizer, lr=r.lr), r.batch_size


def _tp_plan(
    build: Callable[[], nn.Module],
) -> tuple[dict[str, str] | None, Callable[[int], bool]]:
    """TensorParallel's default plan for the model (None: no Linear pairs), and which
    degrees it accepts (heads and widths must divide)."""
    from scaletrain.strategies.tensor_plan import check_tp_plan, default_tp_plan

    with torch.device("meta"):
        net = build()
    try:
        tp_plan = default_tp_plan(net)
    except ConfigError:
        return None, lambda degree: degree == 1

    def accepts(degree: int) -> bool:
        try:
            check_tp_plan(net, tp_plan, degree)
        except ConfigError:
            return False
        return True

    return tp_plan, accepts


def tp_plan_of(build: Callable[[], nn.Module]) -> dict[str, str] | None:
    """TensorParallel's default plan for the model (None: it has no Linear pairs)."""
    return _tp_plan(build)[0]


@dataclass(frozen=True, slots=True)
class RuntimeCost:
    """What scaletrain's own training step costs beyond the bare model's, measured."""

    step: float
    """CPU seconds per step beyond the bare forward, backward and optimizer step."""
    growth: int | None
    """RSS its first steps add after rt.setup, as a run's ledger measures it (None: no
    peak RSS to restart here)."""
    whole: float | None = None
    """Median CPU seconds of those first steps after the first, each timed alone: the
    whole training step as a run's ledger measures it."""


GPU_WARMUP = 8
"""Steps run before a GPU's step is timed."""
GPU_BLOCKS = 12
"""Back-to-back blocks (plan/meter.py's BLOCK steps each) a GPU's step is the median of."""
GPU_SECONDS = 3.0
"""About how long the timing of a GPU's step may take, warm-up included."""


def runtime_overhead(
    build: Callable[[], nn.Module],
    example: Callable[[int], Any],
    loss: Any,
    optimizer: Callable[[Any], Any],
    batch: int,
    *,
    repeats: int = 7,
    device: torch.device | None = None,
    precision: str = "32",
) -> RuntimeCost | None:
    """scaletrain's own step (rt.forward_backward, rt.step, the step ledger) on one
    process, against the bare model's forward, backward and optimizer step.

    Memory first, in a fresh process (what `scaletrain plan` is): the RSS the first
    steps add after rt.setup, exactly what a 1-process run's ledger reports; a bare
    loop's growth was 5-7 MiB short of it for both recipes (the runtime's own threads
    and buffers). Then time: the two loops in turns, so a drift of the machine hits both
    alike; a bare loop alone predicted the recipes' steps 5-25% short. On a GPU
    (`device` cuda): the memory CUDA's allocator adds, and GPU seconds per step back to
    back (plan/meter.py). None inside a job (a process group exists): nothing is
    measured there."""
    import tempfile

    import torch.distributed as dist

    from scaletrain.plan.meter import BLOCK, Peak, in_turns, is_cuda, median_time, move, sync
    from scaletrain.runtime import LedgerConfig, init

    if dist.is_available() and dist.is_initialized():
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = LedgerConfig(out=tmp, every=10, flops=False, summary=False)
            rt = init(
                strategy="ddp", ledger=ledger, precision=precision,
                device=str(device) if device is not None else "cpu",
            )  # fmt: skip
            try:
                x, y = move(example(batch), rt.device)
                torch.manual_seed(0)
                net = build()
                model, opt = rt.setup(net, optimizer(net.parameters()))
                rt.prepare(model, x)

                def ours() -> None:
                    rt.forward_backward(model, x, y, loss)
                    rt.step(opt)
                    opt.zero_grad(set_to_none=True)

                peak = Peak(rt.device)
                # Two of the ledger's windows (every 10 steps): RSS creeps for a while
                # (the convnet recipe's grew 30-34 MiB in 11 steps, 33-35 in 20 and 40).
                if is_cuda(rt.device):
                    # A launch-bound step (the recipes': 2-12 ms on an H200) runs slower
                    # for its first steps and then moves +-15% over a few blocks: 4
                    # blocks after 1 step read a gpt step 7.1-9.8 ms in one process,
                    # whose run's steps had medians of 7.8-8.9. Warmed up, and the
                    # median of more blocks, as a run's median is of all its steps.
                    # A slow model's (0.5 s a step) is timed over fewer: about
                    # GPU_SECONDS in all, at least 4 blocks.
                    sync(rt.device)
                    t0, done = time.perf_counter(), 0
                    while done < GPU_WARMUP and time.perf_counter() - t0 < GPU_SECONDS / 3:
                        ours()
                        done += 1
                    sync(rt.device)
                    each = (time.perf_counter() - t0) / max(1, done)
                    blocks = int(GPU_SECONDS / (each * BLOCK)) if each > 0 else GPU_BLOCKS
                    whole = median_time(ours, min(GPU_BLOCKS, max(4, blocks)), rt.device)[1]
                else:
                    spent = []
                    for _ in range(20):
                        c0 = time.process_time()
                        ours()
                        spent.append(time.process_time() - c0)
                    whole = statistics.median(spent[1:])
                growth = peak.growth()
                torch.manual_seed(0)
                # As the runtime sets the model and its input up (bf16-true: both in
                # bfloat16), so that the difference is the runtime's own step.
                bare = rt.precision.convert_module(build().to(rt.device))
                bare_opt = optimizer(bare.parameters())
                cast = rt.precision.forward_context
                bare_x = rt.precision.convert_input(x)

                def theirs() -> None:
                    bare_opt.zero_grad(set_to_none=True)
                    with cast():
                        out = loss(bare(bare_x), y)
                    out.backward()
                    bare_opt.step()

                cpu = in_turns({"ours": ours, "theirs": theirs}, repeats, rt.device)
            finally:
                rt.shutdown()
    finally:
        torch.set_num_threads(threads)
    step = max(0.0, cpu["ours"] - cpu["theirs"])
    return RuntimeCost(step=step, growth=growth, whole=whole)


CALIBRATIONS = 3
"""Processes the model's step is calibrated in: this one and fresh ones, the median
taken. The same step runs 7.2-11.3 ms in one fresh process or another here (the
convnet recipe: glibc returns freed memory to the system or keeps it by where the
process's allocations fell; with trimming off, 7.2-8.2), and a run's processes are as
many draws: one calibration read a recipe's 1-process step 16-20% short in two runs."""


def _calibration(
    build: Callable[[], nn.Module],
    example: Callable[[int], Any],
    loss: Any,
    optimizer: Callable[[Any], Any],
    batch: int,
    sizes: list[int],
    stage: int | None,
    device: torch.device | None = None,
    precision: str = "32",
) -> Compute:
    """One calibration in this process: the runtime's step first (its memory is a fresh
    process's first steps), then the model's (plan.api.calibrate)."""
    from dataclasses import replace

    from scaletrain.plan.api import calibrate
    from scaletrain.plan.meter import is_cuda

    if not is_cuda(device):
        # The CPU planner times the fp32 step, as its accuracy was measured (mixed
        # precision on a CPU is not modelled; fp16-mixed does not run on one).
        precision = "32"
    cost = runtime_overhead(
        build, example, loss, optimizer, batch, device=device, precision=precision
    )
    compute = calibrate(
        build, example, loss, optimizer, sizes, stage_batch=stage, device=device,
        precision=precision,
    )  # fmt: skip
    if cost is None:
        return compute
    # A pipeline's microbatches as the calibration timed them, not scaled to the batch's
    # loop (Compute.levels): that loop's level holds where its process's allocations
    # fell, which a microbatch's step does not share; and a stage runs its microbatches
    # back to back, as the calibration does, with no optimizer step between them. The
    # batch itself is the loop's (below).
    levels = {size: t for size, t in compute.levels.items() if size != batch}
    # The line's (the calibration keeps each size's own time in levels: the batch's is
    # the loop's below, scaled with the line).
    bare = compute.line(batch) + compute.optimizer
    # The model's time at the level of the real training loop's, its shape (what is per
    # sample, what the optimizer takes) from the calibration's sweep: timed in turns
    # with another loop, or forward and backward apart from the optimizer, the same
    # step ran 10-20% faster than a run's (the convnet recipe: 6.9-8.0 ms against
    # 7.5-10), the allocator reusing what the other loop freed.
    scale = (cost.whole - cost.step) / bare if cost.whole and bare > 0 else 1.0
    if scale > 0:
        compute = replace(
            compute,
            fixed=compute.fixed * scale,
            per_sample=compute.per_sample * scale,
            optimizer=compute.optimizer * scale,
            scale=scale,
        )
    return replace(
        compute,
        overhead={**compute.overhead, "step": cost.step},
        measured_growth=cost.growth if cost.growth is not None else compute.measured_growth,
        levels=levels,
    )


def calibrated(
    build: Callable[[], nn.Module],
    example: Callable[[int], Any],
    loss: Any,
    optimizer: Callable[[Any], Any],
    batch: int,
    sizes: list[int],
    stage: int | None = None,
    *,
    samples: int = CALIBRATIONS,
    device: torch.device | None = None,
    precision: str = "32",
) -> Compute:
    """The model calibrated in this process and in `samples` - 1 fresh ones, one after
    another: the one whose step is the median, with the median RSS growth. Only where
    a step is short (each fresh process costs a start of Python and torch, ~2 s, and
    ~40 steps), and not inside a job (st.plan called by a rank: this process alone);
    a calibration that fails in a fresh process is left out. On a GPU (`device` cuda)
    this process alone: the spread between processes is the CPU allocator's (below),
    and each fresh process would pay CUDA's start again."""
    from dataclasses import replace

    from scaletrain.plan.meter import is_cuda
    from scaletrain.plan.overhead import in_fresh_process

    if is_cuda(device):
        samples = 1
    args = (build, example, loss, optimizer, batch, sizes, stage, device, precision)
    found = [_calibration(*args)]

    def step(c: Compute) -> float:
        return c.fwd_bwd(batch) + c.optimizer + c.overhead.get("step", 0.0)

    import torch.distributed as dist

    in_a_job = dist.is_available() and dist.is_initialized()
    if step(found[0]) < 0.5 and not in_a_job:
        for _ in range(samples - 1):
            more = in_fresh_process(_calibration, *args)
            if more is not None:
                found.append(more)
    found.sort(key=step)
    middle = found[len(found) // 2]
    if len(found) % 2 == 0:
        # Two middles (a fresh process failed): their mean, not the slower one: the
        # faster one's model work scaled to the two's mean, their overheads averaged.
        low, high = found[len(found) // 2 - 1], middle

        def model(c: Compute) -> float:
            return c.fwd_bwd(batch) + c.optimizer

        f = (model(low) + model(high)) / 2 / model(low) if model(low) > 0 else 1.0
        overhead = {
            k: (v + high.overhead.get(k, v)) / 2 for k, v in low.overhead.items()
        }  # fmt: skip
        levels = {k: (v + high.levels.get(k, v)) / 2 for k, v in low.levels.items()}
        middle = replace(
            low, fixed=low.fixed * f, per_sample=low.per_sample * f,
            optimizer=low.optimizer * f, overhead=overhead, scale=low.scale * f,
            levels=levels,
        )  # fmt: skip
    growths = [c.measured_growth for c in found if c.measured_growth is not None]
    growth = int(statistics.median(growths)) if growths else None
    return replace(middle, measured_growth=growth)


def plan(
    recipe: str | None = None,
    *,
    model: str | None = None,
    devices: int = 1,
    nodes: int = 1,
    hardware: str | None = None,
    batch_size: int | None = None,
    precision: str = "32",
    overlap: float | None = None,
    layouts: list[Layout] | None = None,
    compute: Compute | None = None,
    comm: CommModel | None = None,
    device: str | None = None,
    mfu: float | None = None,
    ac: str = "none",
    ac_every: int | None = None,
) -> Plan:
    """Memory per device and step time of every layout of `devices` for a recipe or a
    model ("module:factory"); see scaletrain.plan. Returns data (`Plan.rows`,
    `Plan.recommended`); `Plan.table()` is what `scaletrain plan` prints.

    hardware=None measures this machine: its GPU where it has one (1 device; 10-20 s on
    an H200 for the recipes), else its CPU (calibrations of the model and a Gloo probe,
    20-55 s on 2 CPU cores); `device` "cpu" measures the CPU of a GPU machine, "cuda"
    insists on its GPU. A profile name ("h100-sxm", "a100-sxm", "a100-pcie", "ethernet")
    plans on paper, at `mfu` of its datasheet peak (default 40%). `layouts` picks rows; `compute` and `comm` replace this machine's
    measurements (a benchmark measures them once for many plans). `ac`/`ac_every` plan
    with activation checkpointing as training takes it: the model is profiled with its
    blocks checkpointed, so its activation memory and its recomputed FLOPs are measured,
    not modelled.
    """
    name, build, example, loss, optimizer, default_batch = resolve_model(recipe, model)
    if ac != "none" or ac_every is not None:
        from scaletrain.strategies.levers import check_levers

        check_levers("plan(...)", ac, ac_every, False)
        build = partial(_checkpointed, build, ac, ac_every)
    batch = default_batch if batch_size is None else batch_size
    precision = canonical(precision)  # bf16 is bf16-mixed, as st.init takes it
    check_request(devices, nodes, hardware, precision, batch, device, mfu)
    tp_plan, accepts = _tp_plan(build)
    if layouts is None:
        with torch.device("meta"):
            count = len(list_layers(build()))
        tensor_ok = tp_plan is not None
        layouts = [
            x
            for x in layouts_for(devices, batch=batch, layers=count, tensor_ok=tensor_ok)
            if accepts(x.tp)
        ]
    if compute is None and hardware is None:
        from scaletrain.plan.api import calibration_sizes, measuring_device, stage_batch

        compute = calibrated(
            build, example, loss, optimizer, batch, calibration_sizes(layouts, batch),
            stage_batch(layouts, batch), device=measuring_device(hardware, device),
            precision=precision,
        )  # fmt: skip
    return plan_model(
        build, example, loss_fn=loss, optimizer=optimizer, batch_size=batch,
        devices=devices, nodes=nodes, hardware=hardware, precision=precision,
        tp_plan=tp_plan, overlap=overlap, name=name, layouts=layouts, compute=compute,
        comm=comm, fsdp_units=fsdp_units_of(build), device=device, mfu=mfu,
    )  # fmt: skip


def _checkpointed(build: Callable[[], nn.Module], ac: str, every: int | None) -> nn.Module:
    """build() with its blocks checkpointed (a module-level function: the probes'
    processes unpickle it)."""
    from scaletrain.strategies.levers import apply_levers

    model = build()
    apply_levers(model, ac=ac, ac_every=every, owner="plan(...)")
    return model


def fsdp_units_of(build: Callable[[], nn.Module]) -> list[str]:
    """The modules the fsdp strategy (wrap="auto") shards as units, by name: what the
    planner's probe shards the model's steps by (on the meta device: no weights)."""
    from scaletrain.strategies.fsdp import auto_wrap_targets

    with torch.device("meta"):
        return auto_wrap_targets(build())


# Checking a run (plan --check) lives in scaletrain.train.checking; its names are
# importable from here too.
from scaletrain.train.checking import (  # noqa: E402
    Check,
    check_run,
    layout_of,
    measured,
    measured_allocated,
    measured_cpu,
)
