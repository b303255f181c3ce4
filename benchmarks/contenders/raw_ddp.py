"""Hand-written PyTorch DDP, as the seeds write it: torchrun's variables, DistributedSampler,
DataLoader over a float TensorDataset, DistributedDataParallel (all defaults).

    torchrun --standalone --nproc-per-node 2 raw_ddp.py --record /tmp/r
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import ConvNet, Recorder, fashion_mnist_float, lr_at, parse_args, sgd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(ConvNet())
    optimizer = sgd(model.parameters())
    train_set = fashion_mnist_float(args.data_dir)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    recorder = Recorder(args.record, rank, args.steps)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args.steps)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            recorder.step(loss)
            if step == args.steps:
                break
        epoch += 1
    recorder.write()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
