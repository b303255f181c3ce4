"""Each layer's share of a training step's time, measured on the real model.

A pipeline stage's time is the time of its layers, and FLOPs do not tell it on a
CPU: the ConvNet's first two layers hold 99.5% of its FLOPs but their BatchNorm,
ReLU and pooling cost time no FLOP counter sees, and the loss and the last Linear
run in a stage of their own. So each layer (its module and the parameter-free ones
that join it: scaletrain.plan.partition.Layer.members) runs alone on the input it
got in the model's forward, forward and backward, timed in CPU seconds; the loss
likewise on the model's output. The input gets a gradient where the model's did (a
later stage computes its input's gradient to send back, the first stage does not).
What runs outside any layer (a reshape, an addition in the model's forward) is not
timed: the shares are of what was, and the planner scales them to the whole
model's measured step. A module the forward calls k times counts k calls of its
first. Timing runs the modules' forwards: BatchNorm's running statistics move, as in
any training step (the calibration's model is thrown away after).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from scaletrain.strategies.partition import Layer

__all__ = ["LOSS", "layer_shares"]

LOSS = ""
"""The key of the loss's share (it runs on the last stage)."""


def _fresh(value: Any) -> Any:
    """A copy of a captured input, detached, with a gradient where the original had one."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad and value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _outputs(v)]
    return []


def _timed(
    run: Callable[..., Any],
    inputs: tuple[Any, Any],
    params: Sequence[nn.Parameter],
    repeats: int,
) -> tuple[float, float]:
    """Median CPU seconds of `run(*args, **kwargs)` and of its backward, after one
    warm-up; each call on a fresh copy of `inputs` = (args, kwargs), made untimed."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(repeats + 1):
        args, kwargs = _fresh(inputs[0]), _fresh(inputs[1])
        c0 = time.process_time()
        outs = _outputs(run(*args, **kwargs))
        c1 = time.process_time()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        c2 = time.process_time()
        for p in params:
            p.grad = None  # as zero_grad(set_to_none=True): the next backward allocates
        if i:
            fwd.append(c1 - c0)
            bwd.append(c2 - c1)
    return statistics.median(fwd), statistics.median(bwd)


def layer_shares(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    layers: Sequence[Layer],
    *,
    repeats: int = 5,
) -> dict[str, tuple[float, float]] | None:
    """{layer name: (forward, backward)} as fractions of the timed whole, and LOSS's;
    None where a layer does not run alone (the planner then splits by FLOPs)."""
    x, y = batch
    captured: dict[str, tuple[Any, Any]] = {}
    calls: dict[str, int] = {}
    names = {n: m for n, m in model.named_modules()}
    members = [(layer.name, name) for layer in layers for name in layer.members]

    def remember(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: Any, kwargs: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            if name not in captured:
                captured[name] = (_fresh(args), _fresh(kwargs))

        return hook

    handles = [
        names[name].register_forward_pre_hook(remember(name), with_kwargs=True)
        for _, name in members
        if name in names
    ]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    times: dict[str, tuple[float, float]] = {}
    try:
        for owner, name in members:
            if name not in captured:
                continue  # not called in the forward
            module = names[name]
            f, b = _timed(module, captured[name], list(module.parameters()), repeats)
            # A module the forward calls k times (a shared activation) costs k calls; timed
            # on its first call's input.
            f, b = f * calls[name], b * calls[name]
            prev = times.get(owner, (0.0, 0.0))
            times[owner] = (prev[0] + f, prev[1] + b)
        times[LOSS] = _timed(loss_fn, ((out, y), {}), [], repeats)
    except Exception:  # a module that needs the model around it: FLOPs then
        return None
    total = sum(f + b for f, b in times.values())
    if total <= 0:
        return None
    return {k: (f / total, b / total) for k, (f, b) in times.items()}
