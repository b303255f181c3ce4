"""The same loop on scaletrain's library: st.init, rt.setup, rt.loader, its dataset.

scaletrain launch --nproc-per-node 2 scaletrain_ddp.py --record /tmp/s
"""

from __future__ import annotations

import torch
from common import ConvNet, Recorder, lr_at, parse_args, sgd

import scaletrain as st
from scaletrain.data import load_dataset


def main() -> None:
    args = parse_args()
    rt = st.init(strategy="ddp")
    torch.manual_seed(0)
    model = ConvNet()
    model, optimizer = rt.setup(model, sgd(model.parameters()))
    train_set = load_dataset("fashion-mnist", args.data_dir, split="train")
    loader = rt.loader(train_set, batch_size=args.batch_size, shuffle=True, seed=0, drop_last=True)
    recorder = Recorder(args.record, rt.rank, args.steps)
    step = 0
    while step < args.steps:
        for images, labels in loader:  # reshuffles every epoch by itself
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
    recorder.write()
    del model, optimizer
    rt.shutdown()


if __name__ == "__main__":
    main()
