"""The training loop's two plain functions: one optimizer step, and an exact evaluation.

They use only the public API (rt.accumulate, rt.forward_backward, rt.step,
rt.predict, rt.reduce), so a user's own loop can call them as they are.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from scaletrain.errors import ConfigError, article
from scaletrain.runtime import Runtime

__all__ = [
    "EvalResult",
    "TimedBatches",
    "cross_entropy_sums",
    "evaluate",
    "logits_of",
    "seed_everything",
    "train_step",
]


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights without a broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class TimedBatches:
    """An iterator over a loader that adds up the time spent waiting for its batches;
    `first` sees the first batch before the step does (a check of what it holds)."""

    def __init__(self, loader: Any, first: Callable[[Any], None] | None = None) -> None:
        self._it: Iterator[Any] = iter(loader)
        self.wait_s = 0.0
        self._first = first

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            batch = next(self._it)
        finally:
            self.wait_s += time.perf_counter() - start
        if self._first is not None:
            check, self._first = self._first, None
            check(batch)
        return batch


def train_step(
    rt: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[Any, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor],
    *,
    accumulate: int = 1,
    clip_grad: float | None = None,
    token_loss: bool = False,
) -> torch.Tensor:
    """One optimizer step over the next `accumulate` (inputs, targets) micro-batches.

    The gradient all-reduce runs once, on the last micro-batch; gradients are clipped
    to the whole model's norm `clip_grad` (if given), the optimizer steps and the
    gradients are cleared. Returns the mean loss of this rank's micro-batches,
    detached, on the device (no GPU synchronisation).

    `token_loss`: the loss is normalised by the step's count of targets (those not
    -100) over every micro-batch and every data-parallel rank, as one process on the
    whole batch would: `loss_fn(outputs, targets, num_items=N)` returns its sum over
    the batch divided by N. A mean per micro-batch and per rank (the default) weighs a
    token of a micro-batch with little real text more than one of a full micro-batch;
    with ragged padding that is another gradient than the whole batch's. It costs one
    small all-reduce of the count per step, before the first forward.
    """
    micro = [_next_micro(batches, index, accumulate) for index in range(accumulate)]
    num_items: int | None = None
    local_items = 0
    scale = 1.0
    if token_loss:
        local_items = sum(int((y != -100).sum()) for _, y in micro)
        # Tensor/pipeline peers of a replica hold the same batch: counted once each.
        copies = rt.world_size // rt.dp_size
        num_items = max(int(rt.reduce({"n": local_items}, checked=False)["n"]) // copies, 1)
        # rt.forward_backward counts each micro-batch 1/accumulate, the gradient
        # all-reduce averages over the data-parallel ranks and a pipeline over its
        # microbatches: a sum over N is what those means must come to.
        scale = float(rt.dp_size * accumulate * rt.strategy.batch_splits())

        @functools.wraps(loss_fn)  # an error about the loss names the user's function
        def scaled(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(outputs, targets, num_items=num_items) * scale

    total: torch.Tensor | None = None
    for x, y in micro:
        x = x.to(rt.device, non_blocking=True)
        with rt.accumulate(model, steps=accumulate):
            loss = rt.forward_backward(model, x, y, scaled if token_loss else loss_fn)
        total = loss if total is None else total + loss.to(total.device)
    assert total is not None
    if clip_grad is not None:
        rt.clip_grad_norm(model, optimizer, clip_grad)
    rt.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    if token_loss:
        # Each returned value is this micro-batch's loss sum x scale / N (a pipeline's:
        # the mean over its microbatches of theirs): back to this rank's mean per target.
        assert num_items is not None
        sums = total * (rt.strategy.batch_splits() * num_items / scale)
        return sums / max(local_items, 1)
    return total / accumulate if accumulate > 1 else total


def _next_micro(
    batches: Iterator[tuple[Any, torch.Tensor]], index: int, accumulate: int
) -> tuple[Any, torch.Tensor]:
    try:
        return next(batches)
    except StopIteration:
        raise ConfigError(
            f"train_step needs {accumulate} micro-batch(es) for one optimizer step, but the "
            f"loader ran out after {index}. Give it an iterator with at least that many "
            "batches left (drop the partial accumulation window at an epoch's end)."
        ) from None


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float
    accuracy: float
    count: int


@torch.no_grad()
def evaluate(
    rt: Runtime,
    model: nn.Module,
    loader: Any,
    *,
    on_batch: Callable[[], None] | None = None,
    max_batches: int | None = None,
    sums: Callable[[Any, torch.Tensor], tuple[Any, Any, Any]] | None = None,
) -> EvalResult:
    """Loss and accuracy over a loader built with pad=False: each sample counted once.

    Shards differ by at most one sample, so a rank may have one batch fewer than
    its peers. Strategies whose forward runs collectives (FSDP, tensor, pipeline)
    need every rank to take part in every forward: a rank that ran out repeats its
    last batch and discards the result, so the counts stay exact. `on_batch` runs
    after every batch (the hang watchdog's heartbeat: a long evaluation is progress).
    `max_batches` evaluates only the first that many batches of every rank. `sums`
    gives one batch's (loss summed, correct, counted) from the model's outputs and the
    targets (a Recipe's eval_sums); by default cross-entropy and argmax accuracy over
    the last dimension of the outputs (or their `logits`), targets of -100 not counted.

    The model evaluated is the one a checkpoint records: data-parallel replica 0's
    buffers (BatchNorm statistics) on every rank, each rank's own restored after
    (Runtime.first_replica_buffers), so evaluating never changes the training run.
    """
    with rt.first_replica_buffers(model):
        return _evaluate(
            rt,
            model,
            loader,
            on_batch=on_batch,
            max_batches=max_batches,
            sums=sums or cross_entropy_sums,
        )


def _evaluate(
    rt: Runtime,
    model: nn.Module,
    loader: Any,
    *,
    on_batch: Callable[[], None] | None,
    max_batches: int | None,
    sums: Callable[[Any, torch.Tensor], tuple[Any, Any, Any]],
) -> EvalResult:
    remaining = getattr(loader, "remaining", None)
    if callable(remaining) and remaining() < len(loader):
        # An earlier pass stopped early (max_batches): start this one from the top.
        loader.set_epoch(loader.epoch + 1)
    net = rt.unwrap(model)
    was_training = net.training
    net.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    correct = torch.zeros((), dtype=torch.int64, device=rt.device)
    count = torch.zeros((), dtype=torch.int64, device=rt.device)
    batches = len(loader)
    if max_batches is not None:
        batches = min(batches, max_batches)
    most = int(rt.reduce({"batches": batches}, op="max", checked=False)["batches"])
    last: tuple[Any, torch.Tensor] | None = None
    for index, (x, y) in enumerate(loader):
        if index == batches:
            break
        last = (x, y)
        x = x.to(rt.device, non_blocking=True)
        outputs = rt.predict(model, x)
        batch_loss, batch_correct, batch_count = sums(outputs, y)
        loss_sum += torch.as_tensor(batch_loss).double().to(loss_sum.device)
        correct += torch.as_tensor(batch_correct).to(device=correct.device, dtype=correct.dtype)
        # Added up on the device: no synchronisation per batch.
        count += torch.as_tensor(batch_count).to(device=count.device, dtype=count.dtype)
        if on_batch is not None:
            on_batch()
    for _ in range(most - batches):
        if last is not None:
            rt.predict(model, last[0].to(rt.device))
    net.train(was_training)
    totals = rt.reduce(
        {"loss_sum": loss_sum, "correct": correct, "count": count}, op="sum", checked=False
    )
    # Tensor/pipeline peers of one replica computed the same numbers on the same
    # shard: the sum over all ranks counts each replica's results that many times.
    copies = rt.world_size // rt.dp_size
    n = int(totals["count"]) // copies
    totals["loss_sum"] = totals["loss_sum"] / copies
    totals["correct"] = totals["correct"] // copies
    if n == 0:
        return EvalResult(loss=float("nan"), accuracy=float("nan"), count=0)
    return EvalResult(
        loss=float(totals["loss_sum"]) / n, accuracy=float(totals["correct"]) / n, count=n
    )


def logits_of(outputs: Any) -> torch.Tensor:
    """The prediction tensor of a model's outputs: the tensor itself, or the `logits` of
    a Hugging Face style output (a ModelOutput, or any object or dict holding them)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, dict) else None
    if logits is None:
        logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ConfigError(
        f"the model returned {article(type(outputs).__name__)}, which is neither a tensor of "
        "predictions nor holds `logits`. Fix: define loss(outputs, targets) and "
        "metrics(outputs, targets) in the model's module for outputs of that kind."
    )


def cross_entropy_sums(
    outputs: Any, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy summed, argmax hits, targets counted) over one batch: over the last
    dimension of the outputs (or of their `logits`), targets of -100 not counted (the
    padding Hugging Face's labels mark). Summed in fp32 at least, as Recipe.loss takes
    it: autocast computes cross-entropy so, and a sharded FSDP evaluation, which runs
    without autocast, hands it bf16 logits (a bf16 sum of a thousand losses near 2 is
    off by whole units)."""
    logits = logits_of(outputs)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    flat = logits.reshape(-1, logits.shape[-1])
    y = targets.reshape(-1).to(flat.device, non_blocking=True)
    keep = y != -100
    loss_sum = nn.functional.cross_entropy(flat, y, reduction="sum")
    correct = ((flat.argmax(dim=1) == y) & keep).sum()
    return loss_sum, correct, keep.sum()
