"""The seeds' DDP script with scaletrain: the same training as ddp_raw.py.

Runs the same under torchrun, srun, mpirun, SageMaker, Kubeflow, or alone:

    scaletrain launch examples/ddp_scaletrain.py --epochs 2
    python examples/ddp_scaletrain.py            # one process, no wrapper
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import scaletrain as st
from scaletrain.data import load_dataset
from scaletrain.train import ConvNet, evaluate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()

    rt = st.init(strategy="ddp")  # env, process group, backend, device
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    model, optimizer = rt.setup(model, optimizer)

    with rt.rank_zero_first():  # one reader per node first, the others after
        train_set = load_dataset("fashion-mnist", args.data_dir, split="train")
        test_set = load_dataset("fashion-mnist", args.data_dir, split="test")
    loader = rt.loader(train_set, batch_size=args.batch_size, shuffle=True, seed=0)
    val_loader = rt.loader(test_set, batch_size=1000, shuffle=False, pad=False)

    total = len(loader) * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=total, pct_start=0.15
    )

    step, train_time = 0, 0.0
    for epoch in range(args.epochs):  # the loader reshuffles every epoch by itself
        model.train()
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(rt.device, non_blocking=True)
            labels = labels.to(rt.device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                rt.print(
                    f"Epoch [{epoch + 1}/{args.epochs}], Step [{step}/{total}], Loss: {loss.item():.4f}"
                )
            if step == total:
                break
        train_time += time.perf_counter() - start
        result = evaluate(rt, model, val_loader)  # exact: every test sample once
        rt.print(f"Epoch = {epoch + 1:2d}: Validation Accuracy = {result.accuracy:5.3f}")
        if step == total:
            break

    samples_per_s = step * args.batch_size * rt.world_size / train_time
    rt.print(f"train samples/s: {samples_per_s:.1f}")
    del model, optimizer
    rt.shutdown()


if __name__ == "__main__":
    main()
