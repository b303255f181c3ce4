"""Recipes: the seeds' models with the data and optimiser settings that train them well."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.errors import ConfigError

__all__ = ["RECIPES", "ConvNet", "Recipe", "get_recipe"]


class ConvNet(nn.Module):
    """The seeds' MNIST ConvNet: conv5x5-16 BN ReLU pool, conv5x5-32 BN ReLU pool, linear."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        side = image_size // 4
        self.fc = nn.Linear(side * side * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        return self.fc(out)


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
