"""What every contender of benchmarks/peers.py shares, in plain PyTorch (no scaletrain).

The peers' scripts import it too and run in a venv without scaletrain, so it imports
only torch and numpy. Everything here is what makes the contenders train the SAME
run as `scaletrain train` (same weights, data order, inputs, learning rates), so
that they must end with the same loss:

- the seeds' ConvNet, built right after `torch.manual_seed(0)`;
- Fashion-MNIST read from its IDX files, normalised by the same float32 multiply-add
  as scaletrain's dataset (bitwise the same inputs);
- the learning rate of `scaletrain train`'s recipe: 100 warm-up steps, then cosine;
- `Recorder`: each rank's end-of-step wall time and process CPU time, and the mean
  loss of rank 0 over the last 20 steps (train's last metrics window), written as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "LOG_WINDOW",
    "ConvNet",
    "Recorder",
    "fashion_mnist_float",
    "lr_at",
    "parse_args",
]

MEAN, STD = 0.2860, 0.3530
PEAK_LR, WARMUP = 0.1, 100
LOG_WINDOW = 20
"""`scaletrain train --log-every`'s default: its last metrics record is the mean loss
of rank 0's last 20 steps."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--record", required=True, help="each rank writes RECORD.rank<r>.json")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (fabric_ddp.py starts them)")
    return parser.parse_args()


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _idx(root: str, name: str) -> Path:
    plain = Path(root) / name
    return plain if plain.exists() else plain.with_name(name + ".gz")


def fashion_mnist_float(root: str) -> torch.utils.data.TensorDataset:
    """The training set as the seeds build it: float32 N x 1 x 28 x 28, normalised once."""
    x = _read_idx(_idx(root, "train-images-idx3-ubyte"))
    y = _read_idx(_idx(root, "train-labels-idx1-ubyte"))
    std = torch.tensor(STD, dtype=torch.float32)
    scale, shift = 1.0 / (255.0 * std), -torch.tensor(MEAN, dtype=torch.float32) / std
    images = torch.from_numpy(x.copy()).to(torch.float32).mul_(scale).add_(shift).unsqueeze(1)
    return torch.utils.data.TensorDataset(images, torch.from_numpy(y.astype(np.int64)))


class ConvNet(nn.Module):
    """The seeds' MNIST ConvNet (the same layers, in the same order, as scaletrain's)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
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
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def sgd(params: object) -> torch.optim.Optimizer:
    """The recipe's optimizer at its peak learning rate (set per step by lr_at)."""
    return torch.optim.SGD(params, lr=PEAK_LR, momentum=0.9, nesterov=True, weight_decay=5e-4)  # type: ignore[arg-type]


def lr_at(step: int, total: int) -> float:
    """`scaletrain train`'s learning rate for 0-based step `step` (warm-up, then cosine)."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(total - WARMUP, 1))
    return PEAK_LR * 0.5 * (1.0 + math.cos(math.pi * progress))


class Recorder:
    """End-of-step times of this rank, kept in lists (a microsecond per step)."""

    def __init__(self, path: str, rank: int, steps: int) -> None:
        self.path, self.rank, self.steps = path, rank, steps
        self.t: list[float] = []
        self.cpu: list[float] = []
        self.tail = torch.zeros(())
        self.start_cpu = time.process_time()

    def step(self, loss: torch.Tensor) -> None:
        self.t.append(time.time())
        self.cpu.append(time.process_time())
        if len(self.t) > self.steps - LOG_WINDOW:
            self.tail += loss.detach()

    def write(self) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "t": self.t,
            "cpu": self.cpu,
            "loss": self.tail.item() / min(LOG_WINDOW, len(self.t)),
            "torch": torch.__version__,
        }
        Path(f"{self.path}.rank{self.rank}.json").write_text(json.dumps(record))
