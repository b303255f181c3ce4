"""The same loop on Lightning Fabric (CPU, DDP); Fabric starts the other ranks itself.

    python fabric_ddp.py --ranks 2 --record /tmp/f

The loader keeps raw_ddp.py's DistributedSampler (use_distributed_sampler=False), so
every rank sees the same batches as under the other contenders.
"""

from __future__ import annotations

import torch
from common import ConvNet, Recorder, fashion_mnist_float, lr_at, parse_args, sgd
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    args = parse_args()  # Fabric starts the other ranks with this same command line
    fabric = Fabric(accelerator="cpu", devices=args.ranks, strategy="ddp")
    fabric.launch()
    rank, world_size = fabric.global_rank, fabric.world_size
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = sgd(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    train_set = fashion_mnist_float(args.data_dir)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False, move_to_device=False)
    recorder = Recorder(args.record, rank, args.steps)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args.steps)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            recorder.step(loss)
            if step == args.steps:
                break
        epoch += 1
    recorder.write()


if __name__ == "__main__":
    main()
