"""The same loop on Hugging Face Accelerate (CPU, DDP), started by torchrun.

`accelerate launch --cpu --num_processes 2` starts one process on a CPU-only machine,
so torchrun starts the ranks and `Accelerator(cpu=True)` joins them. The loader keeps
the same DistributedSampler as raw_ddp.py (prepare() would re-shard the data in its
own order, and the losses could no longer be compared).

    torchrun --standalone --nproc-per-node 2 accelerate_ddp.py --record /tmp/a
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from common import ConvNet, Recorder, fashion_mnist_float, lr_at, parse_args, sgd
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=True)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = sgd(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
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
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            recorder.step(loss)
            if step == args.steps:
                break
        epoch += 1
    recorder.write()
    accelerator.end_training()


if __name__ == "__main__":
    main()
