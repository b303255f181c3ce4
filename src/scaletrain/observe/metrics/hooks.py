"""Hooks that drive the step ledger from a plain loop: module, loader, optimizer, DDP buckets.

rt.setup installs them on the wrapped model and the optimizer, rt.loader on the loader,
so a user's own loop is measured with no other change:

- forward: a forward pre-hook on the wrapped model (a forward without gradients is
  evaluation); backward starts when the first gradient reaches the model's output (a
  gradient hook on it); backward's compute ends in a callback the autograd engine runs
  when the last gradient is computed, and backward ends in a second one queued from the
  first, which runs after DDP's own (it waits for the gradient all-reduce). The time
  between the two is exposed communication.
- data: the loader's iterator is timed (`next()` is the data wait).
- optimizer: step pre- and post-hooks; the post-hook closes the step.
- torch.compile: dynamo's compile start and end callbacks (`watch_compile`), which also
  run for a backward that AOT autograd compiles lazily at its first run; whatever
  compiled the model (the user before rt.setup, a strategy, a model module), the time is
  the compile phase's.
- pipeline stages (scaletrain's PipelineModule, whose own forward is never called: its
  schedule runs each stage's submodule microbatch by microbatch): each stage's forward
  is forward, the backward from its output is backward, and everything else in the
  schedule (sends and receives, waiting for the other stages: the bubble) is comm.
- DDP buckets (CPU/Gloo, no comm hook of the user's or the strategy's by the first
  forward): an all-reduce hook that does what DDP's default does and records when each bucket was ready and when its all-reduce
  completed (the future's callback runs on Gloo's thread when it does). On NCCL such a
  callback runs when the work is enqueued, not done, so buckets are not timed there.
  Gloo's worker thread frees each such callback after running it, which takes the GIL:
  `settle_callbacks` (rt.shutdown) waits until every one is freed, so none is freed
  while the interpreter finalizes (a thread asking for the GIL then aborts the process).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from scaletrain.observe.metrics.ledger import StepLedger
from scaletrain.observe.metrics.phases import BACKWARD, COMM, DATA

__all__ = [
    "settle_callbacks",
    "watch_compile",
    "watch_ddp",
    "watch_loader",
    "watch_module",
    "watch_optimizer",
    "watch_stages",
]

_ATTR = "_scaletrain_ledger"

_ON_WORKERS: set[weakref.ref[Any]] = set()
"""Bucket callbacks handed to Gloo's worker threads and not freed yet."""


def settle_callbacks(timeout_s: float = 10.0) -> bool:
    """Wait, the GIL released, until the worker threads freed every bucket callback they
    ran (they do right after running it; a thread the kernel has not run since waits
    longer). False if some were not freed within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _ON_WORKERS and time.monotonic() < deadline:
        time.sleep(1e-3)
    return not _ON_WORKERS


_COMPILE_LEDGERS: weakref.WeakSet[StepLedger] = weakref.WeakSet()
"""Ledgers that dynamo's compile callbacks reach."""


def _compile_started(*_: Any) -> None:
    # Older torch calls the callbacks with no argument, newer with a CallbackArgs.
    for ledger in list(_COMPILE_LEDGERS):
        ledger.compile_begin()


def _compile_ended(*_: Any) -> None:
    for ledger in list(_COMPILE_LEDGERS):
        ledger.compile_end()


def watch_compile(ledger: StepLedger) -> bool:
    """Count torch.compile's work as `ledger`'s compile phase; False while torch's
    compiler is not loaded (or this torch has no compile callbacks).

    Dynamo calls its registered start and end callbacks around every compilation on the
    thread that compiles: a frame's trace with its backend (forward), a backward compiled
    lazily at its first run, a recompilation. Importing dynamo to register them costs
    seconds, so this waits until something else has: torch.compile imports it when it is
    called, before the compiled code first runs. The forward hooks call this at every
    forward (a dictionary and a list lookup): until dynamo is loaded, and because
    torch._dynamo.reset() drops every registered callback, ours included. One pair of
    callbacks serves every ledger of the process (held weakly: a ledger dropped without
    rt.shutdown leaves nothing behind)."""
    dynamo = sys.modules.get("torch._dynamo")
    handler = getattr(dynamo, "callback_handler", None)
    starts = getattr(handler, "start_callbacks", None)
    if not isinstance(starts, list):
        return False
    if _compile_started not in starts:
        handler.register_start_callback(_compile_started)  # type: ignore[union-attr]
        handler.register_end_callback(_compile_ended)  # type: ignore[union-attr]
    if not ledger.compile_watched:
        _COMPILE_LEDGERS.add(ledger)
        ledger.compile_watched = True
    return True


def _first_grad_tensors(output: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def watch_module(ledger: StepLedger, module: nn.Module) -> list[Any]:
    """Forward/backward hooks on `module` (the wrapped model); returns the handles."""
    engine = torch.autograd.Variable._execution_engine

    def backward_done() -> None:
        ledger.backward_end()

    def compute_done() -> None:
        ledger.compute_end()
        # Queued now, it runs after the callbacks queued before it, DDP's among them
        # (DDP queues its wait for the all-reduce when its last bucket is ready).
        engine.queue_callback(backward_done)

    def backward_started(*_: Any) -> None:
        ledger.backward_begin()
        engine.queue_callback(compute_done)

    def pre(_module: nn.Module, _args: Any) -> None:
        watch_compile(ledger)
        ledger.forward_begin(torch.is_grad_enabled())

    def post(_module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = _first_grad_tensors(output)
        if len(tensors) == 1:
            tensors[0].register_hook(backward_started)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, backward_started, mode="any")

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def watch_stages(ledger: StepLedger, model: Any) -> bool:
    """Phases for a pipeline's stages, if `model` has them: it offers
    `watch_stages(stage, schedule)` and calls `stage(submodule)` for every stage it
    runs (built at the first batch) and `schedule()` as its schedule starts a training
    step. False when `model` is not staged.

    Without this, a stage's whole schedule counted as the batch's copy to the device
    (h2d: no forward of the wrapped model ever began), and `scaletrain plan --check`,
    which leaves h2d out of the training work, measured a pipeline's step as almost
    nothing."""
    register = getattr(model, "watch_stages", None)
    if not callable(register):
        return False
    engine = torch.autograd.Variable._execution_engine

    def waiting() -> None:
        ledger.set_base(COMM)

    def backward_started(*_: Any) -> None:
        ledger.set_base(BACKWARD)
        engine.queue_callback(waiting)  # this microbatch's backward is done

    def pre(_module: nn.Module, _args: Any) -> None:
        # Evaluation (no gradients) and the FLOP count start as for a whole model.
        watch_compile(ledger)
        ledger.forward_begin(torch.is_grad_enabled())

    def post(_module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        waiting()  # the send, then the next receive
        tensors = _first_grad_tensors(output)
        if len(tensors) == 1:
            tensors[0].register_hook(backward_started)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, backward_started, mode="any")

    def stage(submodule: nn.Module) -> None:
        submodule.register_forward_pre_hook(pre)
        submodule.register_forward_hook(post)

    def schedule() -> None:
        ledger.end_eval()  # a stage after the first waits for its input in training
        waiting()

    register(stage, schedule)
    return True


def watch_optimizer(ledger: StepLedger, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The optimizer's step brackets the optimizer phase; its end closes the step."""

    def pre(*_: Any) -> None:
        ledger.optimizer_begin()

    def post(*_: Any) -> None:
        ledger.optimizer_end()

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


class _TimedIterator:
    __slots__ = ("_it", "_ledger")

    def __init__(self, it: Iterator[Any], ledger: StepLedger) -> None:
        self._it, self._ledger = it, ledger

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        ledger = self._ledger
        ledger.push(DATA)
        try:
            batch = next(self._it)
        except BaseException:
            ledger.pop(DATA)
            raise
        ledger.data_arrived()
        return batch


_TIMED_CLASSES: dict[type, type] = {}


def _timed_class(cls: type) -> type:
    timed = _TIMED_CLASSES.get(cls)
    if timed is None:

        def __iter__(self: Any) -> Iterator[Any]:
            return _TimedIterator(cls.__iter__(self), getattr(self, _ATTR))  # type: ignore[attr-defined]

        # A subclass, so isinstance(loader, ShardedLoader) and every method stay as they were.
        timed = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__})
        timed.__qualname__ = cls.__qualname__
        _TIMED_CLASSES[cls] = timed
    return timed


def watch_loader(ledger: StepLedger, loader: Any) -> Any:
    """Time `next()` on every iterator of `loader` (in place; returns the loader)."""
    if getattr(loader, _ATTR, None) is not None:
        setattr(loader, _ATTR, ledger)
        return loader
    loader.__class__ = _timed_class(type(loader))
    setattr(loader, _ATTR, ledger)
    return loader


def watch_ddp(ledger: StepLedger, ddp: Any) -> None:
    """Time each gradient bucket's all-reduce (CPU/Gloo), unless a comm hook is set.

    DDP takes one comm hook, and a user may register theirs after rt.setup: ours is
    registered at the first forward, and only if none was by then."""
    import torch.distributed as dist

    if ledger.device_type == "cuda":
        return
    group = ddp.process_group
    size = dist.get_world_size(group)

    # No annotations: DDP checks a hook's signature against dist.GradBucket at runtime.
    def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        ready = time.perf_counter()
        tensor = bucket.buffer()
        tensor.div_(size)
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(fut):  # type: ignore[no-untyped-def]
            ledger.bucket(ready, time.perf_counter())
            return fut.value()[0]

        _ON_WORKERS.add(weakref.ref(done, _ON_WORKERS.discard))
        return future.then(done)

    def first_forward(_module: nn.Module, _args: Any) -> None:
        handle.remove()
        if not getattr(ddp, "_comm_hooks", None):
            ddp.register_comm_hook(None, timed_allreduce)

    handle = ddp.register_forward_pre_hook(first_forward)
