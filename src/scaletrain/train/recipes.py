"""Recipes: the seeds' models with the data and optimiser settings that train them well."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.train.models import ConvNet

__all__ = ["RECIPES", "ConvNet", "Recipe", "get_recipe"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Recipe:
    """A model, the dataset it trains on, and an optimiser setting that works for it."""

    name: str
    """Name given to `scaletrain train --recipe`."""
    dataset: str
    """Dataset name understood by scaletrain.data.load_dataset."""
    build: Callable[[], nn.Module]
    """Builds the model (on CPU; the strategy places it)."""
    lr: float
    """Peak learning rate for the global batch of 200 (2 ranks x 100); scaled linearly."""
    momentum: float = 0.9
    """SGD momentum (Nesterov)."""
    weight_decay: float = 5e-4
    """L2 penalty on the weights."""
    reference_batch: int = 200
    """Global batch size at which `lr` was tuned."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; sequence outputs (B, T, V) are flattened to tokens."""
        return nn.functional.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
        )

    def optimizer(self, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=lr, momentum=self.momentum, nesterov=True, weight_decay=self.weight_decay
        )

    def scaled_lr(self, global_batch: int) -> float:
        """Linear scaling rule (Goyal et al.): the same recipe at another world size."""
        return self.lr * global_batch / self.reference_batch


RECIPES: dict[str, Recipe] = {
    "convnet": Recipe(name="convnet", dataset="fashion-mnist", build=ConvNet, lr=0.1),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError(
            f"recipe={name!r} is not known; expected one of {', '.join(sorted(RECIPES))}."
        )
    return RECIPES[name]
