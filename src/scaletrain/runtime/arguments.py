"""The Runtime's checks of what a training loop hands it, where torch would fail far
away or not at all: a loss of more than one number (rt.forward_backward, rt.backward),
and checkpoint objects not passed by name (rt.save, rt.load)."""

from __future__ import annotations

import os
from typing import Any

import torch

from scaletrain.errors import ConfigError, article, say

__all__ = ["by_name", "one_number"]


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
