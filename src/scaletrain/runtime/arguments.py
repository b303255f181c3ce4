"""The Runtime's checks of what a training loop hands it, where torch would fail far
away or not at all: a loss of more than one number (rt.forward_backward, rt.backward),
checkpoint objects not passed by name (rt.save, rt.load), and what rt.setup and
rt.clip_grad_norm are given."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, article, say

__all__ = ["by_name", "check_clip", "check_setup", "one_number"]


def one_number(loss: Any, loss_fn: Any) -> torch.Tensor:
    """`loss` if it is one number to backpropagate (a tensor of one element), else the
    error that names what the loss function returned: a per-sample loss
    (`reduction="none"`) otherwise fails deep in autograd, naming no function."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    what = (
        f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
        else article(type(loss).__name__)
    )  # fmt: skip
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__qualname__
    given = loss_fn is not None
    source = say(
        api=f"the loss_fn given to rt.forward_backward ({name})" if given else "rt.backward's loss",
        cli=f"the model module's loss ({name})" if given else "the loss",
    )
    raise ConfigError(
        f"{source} is {what}; backpropagation needs one number per batch (a tensor with "
        'one element). Fix: reduce it, e.g. loss.mean(), or reduction="mean" for torch\'s '
        "losses.",
        field="loss",
    )


def by_name(call: str, path: Any, unnamed: tuple[Any, ...]) -> None:
    """rt.save / rt.load take the checkpoint directory, then every object by name: the
    name is what a load matches a saved object by."""
    example = f"rt.{call}('runs/x/checkpoints/step-000100', model=model, optimizer=optimizer" + (
        ", step=step)" if call == "save" else ")"
    )
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"rt.{call}({type(path).__name__}, ...): the first argument is the checkpoint "
            f"directory, a str or Path. Fix: {example}."
        )
    if unnamed:
        got = ", ".join(type(o).__name__ for o in unnamed)
        raise ConfigError(
            f"rt.{call}(path, {got}): objects are passed by name (a load matches them by "
            f"name). Fix: {example}."
        )


def check_setup(model: Any, optimizer: Any) -> None:
    """rt.setup's model and optimizer: a module and an optimizer (or none)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"rt.setup(model): got {article(type(model).__name__)}; expected the "
            "torch.nn.Module to train. Fix: rt.setup(model) or rt.setup(model, optimizer)."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"rt.setup(model, optimizer): the optimizer is "
            f"{article(type(optimizer).__name__)}; expected a torch.optim.Optimizer over "
            "the model's parameters. Fix: e.g. rt.setup(model, torch.optim.AdamW("
            "model.parameters())), or rt.setup(model) alone."
        )


def check_clip(optimizer: Any, max_norm: Any, norm_type: Any) -> None:
    """rt.clip_grad_norm's optimizer and norms: a negative max_norm flips the gradients."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"rt.clip_grad_norm(model, optimizer, max_norm): the optimizer is "
            f"{article(type(optimizer).__name__)}; expected the torch.optim.Optimizer "
            "whose gradients to clip (its parameters' gradients are the ones clipped). "
            "Fix: rt.clip_grad_norm(model, optimizer, max_norm=1.0)."
        )
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(
                f"rt.clip_grad_norm(..., {name}={value!r}): expected a positive number "
                "(a negative max_norm would flip the gradients' sign). Fix: e.g. "
                f"{name}={1.0 if name == 'max_norm' else 2.0}."
            )
