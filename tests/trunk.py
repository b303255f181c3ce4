"""A residual MLP whose blocks sit in a nested nn.Sequential beside its input layer
and head: the shape that pipeline stages and device_map="auto" must cut between blocks."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["IN_FEATURES", "OUT_FEATURES", "ResidualBlock", "TrunkNet"]

IN_FEATURES = 10
OUT_FEATURES = 5


class ResidualBlock(nn.Module):
    """x + tanh(Linear(LayerNorm(x))): per sample, so microbatches change nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TrunkNet(nn.Module):
    """embed -> trunk (nn.Sequential of `depth` blocks) -> head."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, width)
        self.trunk = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.embed(x)))
