"""The seeds' single-machine model parallel `Net` in raw PyTorch.

The model hard-codes its devices and moves activations itself. Without two GPUs
this runs both halves on the CPU, to show the wiring.

    python examples/model_parallel_raw.py
"""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, *devices: str) -> None:
        super().__init__()
        self.dev0 = torch.device(devices[0])
        self.dev1 = torch.device(devices[1])
        self.sub_net1 = nn.Linear(10, 10).to(self.dev0)
        self.relu = nn.ReLU()
        self.sub_net2 = nn.Linear(10, 5).to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.sub_net1(x.to(self.dev0)))
        return self.sub_net2(y.to(self.dev1))  # blocking copy between devices


def main() -> None:
    two_gpus = torch.cuda.device_count() >= 2
    devices = ("cuda:0", "cuda:1") if two_gpus else ("cpu", "cpu")
    torch.manual_seed(0)
    model = Net(*devices)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 10), torch.randint(0, 5, (64,))
    for _ in range(20):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"model parallel over {devices}: final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
