"""The seeds' DDP script in raw PyTorch: the ConvNet on Fashion-MNIST.

This is what scaletrain replaces (compare with ddp_scaletrain.py beside it).
The seeds read the data with torchvision; torchvision is not available on CPU
machines here, so a 10-line IDX reader stands in for it.

    torchrun --standalone --nproc-per-node 2 examples/ddp_raw.py --epochs 2
"""

from __future__ import annotations

import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def read_idx(path: str) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist(root: str, split: str) -> TensorDataset:
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"))
    images = torch.from_numpy(x.copy()).float().div(255).sub(0.2860).div(0.3530).unsqueeze(1)
    return TensorDataset(images, torch.from_numpy(y.astype(np.int64)))


class ConvNet(nn.Module):
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args()

    # Process group and device: one process per GPU (NCCL), or Gloo on CPUs.
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = ConvNet().to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )

    # I/O on one worker first (the seeds' download on local rank 0), then the others.
    if local_rank != 0:
        dist.barrier()
    train_set = fashion_mnist(args.data_dir, "train")
    test_set = fashion_mnist(args.data_dir, "test")
    if local_rank == 0:
        dist.barrier()

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=cuda)
    total = len(loader) * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=total, pct_start=0.15
    )

    step, train_time = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                print(
                    f"Epoch [{epoch + 1}/{args.epochs}], Step [{step}/{total}], Loss: {loss.item():.4f}"
                )
            if step == total:
                break
        train_time += time.perf_counter() - start
        # The seeds' validation: each rank on its (padded) shard, then an average.
        model.eval()
        val_sampler = DistributedSampler(
            test_set, num_replicas=world_size, rank=rank, shuffle=False
        )
        val_loader = DataLoader(test_set, batch_size=1000, sampler=val_sampler)
        correct = torch.zeros(1, device=device)
        count = torch.zeros(1, device=device)
        with torch.no_grad():
            for images, labels in val_loader:
                out = model.module(images.to(device))
                correct += (out.argmax(1) == labels.to(device)).sum()
                count += labels.numel()
        accuracy = correct / count
        dist.all_reduce(accuracy)
        accuracy /= world_size
        if rank == 0:
            print(f"Epoch = {epoch + 1:2d}: Validation Accuracy = {accuracy.item():5.3f}")
        if step == total:
            break

    if rank == 0:
        samples_per_s = step * args.batch_size * world_size / train_time
        print(f"train samples/s: {samples_per_s:.1f}")
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
