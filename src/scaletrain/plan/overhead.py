"""What tensor parallel, FSDP and pipelines cost a rank per step beyond the FLOPs they divide.

FLOPs and collectives do not see the framework: every op on a DTensor goes through
sharding propagation in Python, and FSDP runs hooks around every unit's forward and
backward. On this machine (`benchmarks/plan_accuracy.py`, gpt recipe, batch 8) a
tensor-parallel rank spent 180 ms of CPU per step where the plain model needs 73 ms,
and an FSDP rank 156; a planner counting FLOPs predicted 101 and 112.

This measures it on the model itself: the same steps, timed in this process, once
plain and once under each strategy's machinery in a process group of one rank
(`parallelize_module` with the tensor-parallel plan on a 1-device mesh, `fully_shard`
on every layer and the root, DDP's reducer: 0.85 ms a step on the convnet recipe,
1.0 on gpt, which a 1-process calibration never wraps). At one rank no collective moves data, so the
difference is the dispatch and hooks alone, which a rank of a larger group pays too:
it runs the same ops on smaller shards. A pipeline's machinery (the traced graph run
op by op, the schedule's bookkeeping per microbatch) is timed the same way: the model
as one stage under the 1F1B schedule against the plain model stepping over as many
microbatches (gpt, batch 8, 4 microbatches: 112 against 92 ms; a stage of several
runs its share of the ops). Where this process already belongs to a
process group (st.plan called inside a job) nothing is measured, and the planner
says so.

Memory: a pipeline rank traces the model at its first batch (torch.export under
`torch.distributed.pipelining`), after setup, and keeps the traced graphs: its RSS
grew 25-31 MiB more than the stage's tensors account for on both recipes, and one
`torch.export.export` of the model at the microbatch shape grows it by 24-29 MiB.
`measure_trace_bytes` measures that export on the model.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn

from scaletrain.plan.children import ctrl_c_held
from scaletrain.plan.meter import in_turns

T = TypeVar("T")

__all__ = [
    "in_fresh_process",
    "measure_overheads",
    "measure_trace_bytes",
    "model_step",
    "sharded_step",
    "tensor_step",
    "trace_bytes",
]


@contextlib.contextmanager
def _one_rank_group() -> Iterator[bool]:
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield False
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int = 1,
) -> None:
    """One forward, backward and optimizer step; over `microbatches` (gradient
    accumulation), what a pipeline's stages compute without its machinery."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    if microbatches == 1:
        loss_fn(model(x), y).backward()
    else:
        for xc, yc in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            (loss_fn(model(xc), yc) / microbatches).backward()
    optimizer.step()


def model_step(
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
) -> Callable[[], None]:
    """The plain model's training step, built here (probe.probe's `work`, given as a
    functools.partial of this so that it pickles into the probe's processes)."""
    torch.manual_seed(0)
    model = build()
    return partial(_step, model, optimizer(model.parameters()), batch, loss_fn)


def sharded_step(
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    units: Sequence[str],
) -> Callable[[], None]:
    """The model's training step fully sharded over the default process group (an FSDP
    unit per module named in `units`, then the root: `scaletrain plan` names the fsdp
    strategy's), built here: the probe's `sharded` (a functools.partial of this, so
    that it pickles)."""
    torch.manual_seed(0)
    model = _fsdp(build(), units)
    return partial(_step, model, optimizer(model.parameters()), batch, loss_fn)


def tensor_step(
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    tp_plan: Mapping[str, str],
) -> Callable[[], None]:
    """The model's training step tensor-parallel over the default process group (every
    rank the whole batch, as the tensor strategy's ranks have it), built here: the
    probe's `tensored` (a functools.partial of this, so that it pickles)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _tensor(build(), tp_plan, dist.get_world_size())
    return partial(_step, model, optimizer(model.parameters()), batch, loss_fn)


def _tensor(model: nn.Module, tp_plan: Mapping[str, str], size: int = 1) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (size,))
    styles = {
        k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in tp_plan.items()
    }
    return parallelize_module(model, mesh, styles)  # type: ignore[arg-type]


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp(model: nn.Module, layers: Sequence[str]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for name in layers:
        unit = model.get_submodule(name)
        if unit is not model and any(True for _ in unit.parameters()):
            fully_shard(unit)
    fully_shard(model)
    return model


def _pipelined(
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    m: int,
) -> Callable[[], None] | None:
    """The model as one pipeline stage (traced, run by the 1F1B schedule over `m`
    microbatches) in this one-rank group; None where it does not trace."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, pipeline

    x, y = batch
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            # torch 2.13's own tracer trips its own pytree deprecation; not the user's.
            warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec", FutureWarning)
            pipe = pipeline(build(), mb_args=(x[: x.shape[0] // m],))
        stage = pipe.build_stage(0, torch.device("cpu"), dist.group.WORLD)
        opt = optimizer(stage.submod.parameters())
        schedule = Schedule1F1B(stage, m, loss_fn=lambda o, t: loss_fn(o, t) / m, scale_grads=False)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            schedule.step(x, target=y)
            opt.step()

        step()  # once here: a model that traces but does not run staged is not measured
    except Exception:  # the pipeline strategy explains a model it cannot stage
        return None
    return step


def measure_overheads(
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    tp_plan: Mapping[str, str] | None,
    layers: Sequence[str],
    microbatches: int | None = None,
    repeats: int = 7,
) -> dict[str, float] | None:
    """CPU seconds per step each strategy adds to a rank: {"ddp": s, "tensor": s,
    "fsdp": s, "pipeline": s} (tensor only with a plan; pipeline given `microbatches` that divide
    the batch, against the plain step over as many microbatches). None where it
    cannot be measured here (see above)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _one_rank_group() as ours:
            if not ours:
                return None
            wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
                "plain": lambda m: m,
                "ddp": _ddp,
                "fsdp": lambda m: _fsdp(m, layers),
            }
            if tp_plan:
                wrappers["tensor"] = lambda m: _tensor(m, tp_plan)
            steps: dict[str, Callable[[], None]] = {}
            for name, wrap in wrappers.items():
                torch.manual_seed(0)
                model = wrap(build())
                steps[name] = partial(_step, model, optimizer(model.parameters()), batch, loss_fn)
            m = microbatches or 0
            piped = (
                _pipelined(build, batch, loss_fn, optimizer, m)
                if m > 1 and len(batch[0]) % m == 0
                else None
            )
            if piped is not None:
                torch.manual_seed(0)
                model = build()
                steps["chunks"] = partial(
                    _step, model, optimizer(model.parameters()), batch, loss_fn, m
                )
                steps["pipeline"] = piped
            cpu = in_turns(steps, repeats)
    finally:
        torch.set_num_threads(threads)
    base = {"pipeline": cpu.get("chunks", 0.0)}
    return {
        k: max(0.0, v - base.get(k, cpu["plain"]))
        for k, v in cpu.items()
        if k not in ("plain", "chunks")
    }


def measure_trace_bytes(build: Callable[[], nn.Module], microbatch: tuple[Any, ...]) -> int | None:
    """RSS one torch.export of the model at the microbatch's shape adds, in this process
    (None: no peak RSS to restart here, or the model does not export: the pipeline
    strategy would say why). Measured as a rank is at its first trace: torch._dynamo
    imported (its optimizer's constructor does that) and the model run once; in a
    process that has not, the export's own imports add 70 MiB more, and in one that
    has exported before, most of it is already there (`trace_bytes` uses a fresh one)."""
    import torch._dynamo

    from scaletrain.observe.memory import current_rss_bytes, reset_rss_peak, rss_peak_bytes

    model = build()
    with torch.no_grad():
        model(*microbatch)
    if not reset_rss_peak():
        return None
    start = current_rss_bytes()
    try:
        torch.export.export(model, microbatch)
    except Exception:  # an export failure is the pipeline strategy's to explain
        return None
    return max(0, rss_peak_bytes() - start) if start else None


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_and_send(results: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    _ignore_sigint()  # Ctrl-C is the planner's: it kills this process
    try:
        results.put((True, fn(*args)))
    except Exception:  # the measurement's own failure: none, as where it cannot run
        results.put((False, None))


def in_fresh_process(fn: Callable[..., T], *args: Any, timeout: float = 300.0) -> T | None:
    """`fn(*args)` in a fresh (spawned) process; None if it fails, cannot load what it
    was given (a factory defined in a notebook's __main__), or takes over `timeout`
    seconds. Not a multiprocessing.Pool: a worker that dies loading its task is
    replaced and the task lost, so the caller waited out the whole timeout."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_run_and_send, args=(results, fn, args), daemon=True)
    deadline = time.monotonic() + timeout
    try:
        with ctrl_c_held():  # Ctrl-C is the caller's: it kills this process
            proc.start()
        while True:
            try:
                ok, value = results.get(timeout=0.2)
                return value if ok else None
            except queue.Empty:
                if proc.exitcode is not None:  # gone without a result: one last look
                    try:
                        ok, value = results.get(timeout=0.5)
                        return value if ok else None
                    except queue.Empty:
                        return None
                if time.monotonic() > deadline:
                    return None
    except Exception:  # fn or its arguments do not pickle, or no process can start
        return None
    finally:
        if proc.is_alive():  # Ctrl-C, or too slow
            proc.kill()
        if proc.pid is not None:
            proc.join(timeout=10)


def trace_bytes(
    build: Callable[[], nn.Module], microbatch: tuple[Any, ...], *, timeout: float = 300.0
) -> int | None:
    """`measure_trace_bytes` in a fresh process (spawned: a pipeline rank traces once,
    in a process that has not traced before); None if that process fails."""
    return in_fresh_process(measure_trace_bytes, build, microbatch, timeout=timeout)
