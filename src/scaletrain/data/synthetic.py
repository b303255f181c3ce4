"""A synthetic task for the seeds' SplitNet (10 features in, 5 classes out).

Labels come from a fixed random teacher network, so the task is learnable, the
same on every machine, and needs no files.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from scaletrain.errors import ConfigError

__all__ = ["teacher_dataset"]


def teacher_dataset(
    split: str = "train",
    *,
    n_train: int = 20_000,
    n_test: int = 2_000,
    in_features: int = 10,
    classes: int = 5,
    seed: int = 1234,
) -> TensorDataset:
    """(x, y): x ~ N(0, 1), y = argmax of a fixed random two-layer teacher's output."""
    if split not in ("train", "test"):
        raise ConfigError(f"split={split!r}: expected 'train' or 'test'.")
    g = torch.Generator().manual_seed(seed)
    # The same shape as the student (SplitNet), so the task is learnable exactly.
    teacher = nn.Sequential(nn.Linear(in_features, 10), nn.ReLU(), nn.Linear(10, classes))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(n_train + n_test, in_features, generator=g)
        y = teacher(x).argmax(dim=1)
    sl = slice(0, n_train) if split == "train" else slice(n_train, n_train + n_test)
    return TensorDataset(x[sl], y[sl])
