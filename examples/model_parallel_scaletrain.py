"""The seeds' model parallel `Net` with scaletrain: the model knows nothing of devices.

A device map places `sub_net1` and `sub_net2`; activations move between devices at
submodule boundaries by themselves. Compare with model_parallel_raw.py.

    python examples/model_parallel_scaletrain.py
"""

from __future__ import annotations

import torch
from torch import nn

import scaletrain as st
from scaletrain.train.models import SplitNet  # the seeds' Net, without .to() inside


def main() -> None:
    two_gpus = torch.cuda.device_count() >= 2
    device_map = {"sub_net1": "cuda:0", "sub_net2": "cuda:1"} if two_gpus else "auto"
    rt = st.init(strategy=st.ModelParallel(device_map=device_map))
    torch.manual_seed(0)
    model = SplitNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x, y = torch.randn(64, 10), torch.randint(0, 5, (64,))
    for _ in range(20):
        optimizer.zero_grad()
        loss = rt.forward_backward(model, x, y, nn.functional.cross_entropy)
        optimizer.step()
    rt.print(f"model parallel with device_map={device_map!r}: final loss {loss.item():.4f}")
    rt.shutdown()


if __name__ == "__main__":
    main()
