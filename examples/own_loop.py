# own_loop.py -- run: scaletrain launch --nproc-per-node 2 own_loop.py --out runs/own-loop
"""Your own loop, stopped as `scaletrain train` stops: SIGTERM, SIGUSR1 or Ctrl-C, and
every rank finishes its step, saves at the same step and exits 75; the same command
then resumes and ends with the weights an uninterrupted run ends with."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import scaletrain as st

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/own-loop")
parser.add_argument("--steps", type=int, default=1000)
args = parser.parse_args()

rt = st.init(strategy="ddp")
torch.manual_seed(0)  # same weights and data on every rank
x = torch.randn(2000, 20)
data = TensorDataset(x, (x[:, :5].sum(1) > 0).long())
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(data, batch_size=50, seed=0)

manager = st.CheckpointManager(rt, args.out, every=20, keep=2)
state = {"model": model, "optimizer": optimizer, "loader": loader}  # RNG states are saved too
resumed = manager.resume(**state)  # the newest checkpoint that loads, if there is one
step = resumed.values["step"] if resumed.path else 0
if resumed.path:
    rt.print(f"resumed from {resumed.path} at step {step}")

while step < args.steps:
    for xb, yb in loader:  # after a resume: the rest of the epoch it stopped in
        loss = F.cross_entropy(model(xb.to(rt.device)), yb.to(rt.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rt.should_stop():  # True on every rank after the same step
            manager.maybe_save(step, force=True, **state)
            manager.close()
            rt.print(f"stopped at step {step} ({rt.stop_reason}): saved; run again to resume")
            rt.shutdown()
            sys.exit(st.EXIT_PREEMPTED)  # 75, "try again": a scheduler may requeue the job
        manager.maybe_save(step, **state)  # every 20 steps
        if step % 100 == 0:
            rt.print(f"step {step} loss {loss.item():.4f}")
        if step == args.steps:
            break
manager.close()
weights = rt.full_state_dict(model)  # a collective: every rank calls it
if rt.is_main:
    torch.save(weights, Path(args.out) / "model.pt")
rt.print(f"finished at step {step}")
rt.shutdown()
