"""Straggler detection rate and false alarms on Gloo ranks slowed on purpose.

Scenarios (each rank's forward also sleeps `base` s, so a loaded box cannot fake a
straggler and the slowdown is exactly what is asked):
  forward+20%   2 ranks, rank 1's forward sleeps 1.2x as long   (expect: rank 1, forward)
  slow loader   4 ranks, rank 2's loader sleeps 12 ms per batch  (expect: rank 2, data)
  clean         2 ranks, identical; 10 windows of 10 steps       (expect: nobody)
A trial detects when the expected rank is named with the expected phase; a false alarm
is any other rank or phase named for its own work. A rank named for its wait for a CPU
(other processes on the host had its core) is counted apart: on a shared box that can be
what happened. Steps to detection: the step at which it was named.

    .venv/bin/python benchmarks/observe_stragglers.py --trials 5 [--load N]

--load N runs N busy processes beside the ranks (a crowded host: bursts of 5-50 ms of
spinning between idle gaps of up to 20 ms, each), stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def _job(steps: int, every: int, forward_s: float, slow: dict[int, dict[str, float]]) -> Any:
    import torch
    from torch import nn

    import scaletrain as st

    class Net(nn.Module):
        def __init__(self, sleep_s: float) -> None:
            super().__init__()
            self.sleep_s = sleep_s
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(self.sleep_s)
            return self.net(x)

    class Data(torch.utils.data.Dataset[Any]):
        def __init__(self, n: int, sleep_s: float) -> None:
            self.x, self.y = torch.randn(n, 32), torch.randint(0, 4, (n,))
            self.sleep_s = sleep_s

        def __len__(self) -> int:
            return len(self.x)

        def __getitems__(self, idx: list[int]) -> Any:
            time.sleep(self.sleep_s)
            return self.x[idx], self.y[idx]

    rt = st.init(strategy="ddp", ledger=st.LedgerConfig(every=every, summary=False))
    mine = slow.get(rt.rank, {})
    bare = Net(mine.get("forward", forward_s))
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.05))
    loader = rt.loader(Data(16 * steps * rt.world_size, mine.get("data", 0.0)), 16,
                       collate_fn=lambda b: b)  # fmt: skip
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rt.ledger is not None
    named = {
        r: (s.phase, s.last_step, s.waited_for_cpu) for r, s in rt.ledger.detector.named.items()
    }
    windows = len(rt.ledger.windows)
    del model, opt
    rt.shutdown()
    return named, windows


_BUSY = (
    "import random, time\n"
    "while True:\n"
    "    end = time.perf_counter() + random.uniform(0.005, 0.05)\n"
    "    while time.perf_counter() < end: pass\n"
    "    time.sleep(random.uniform(0, 0.02))\n"
)

SCENARIOS = {
    "forward+20%": (2, 20, 50, 0.02, {1: {"forward": 0.024}}, (1, "forward")),
    "slow loader": (4, 20, 50, 0.01, {2: {"data": 0.012}}, (2, "data")),
    "clean": (2, 100, 10, 0.01, {}, None),
}


def main() -> None:
    from scaletrain.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the ranks")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(args.load)]
    try:
        rows = _trials(args.trials, run_ranks)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {time.strftime('%Y-%m-%d')}")
    print(
        "| scenario | ranks | trials | windows | expected | detected | step named (median) "
        "| false alarms | named for a CPU wait |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for name, world, expected, detected, false_alarms, cpu, at, windows in rows:
        exp = f"rank {expected[0]}, {expected[1]}" if expected else "nobody"
        step = f"{statistics.median(at):.0f}" if at else "-"
        det = f"{detected}/{args.trials}" if expected else "-"
        print(
            f"| {name} | {world} | {args.trials} | {windows} | {exp} | {det} | {step} "
            f"| {false_alarms} | {cpu} |"
        )


def _trials(trials: int, run_ranks: Any) -> list[Any]:
    rows = []
    for name, (world, steps, every, base, slow, expected) in SCENARIOS.items():
        detected, false_alarms, cpu, at, windows = 0, 0, 0, [], 0
        for trial in range(trials):
            named, w = run_ranks(_job, world, steps, every, base, slow, timeout=600)[0]
            windows += w
            for rank, (phase, step, waited) in named.items():
                if waited:
                    cpu += 1
                elif expected == (rank, phase):
                    detected += 1
                    at.append(step)
                else:
                    false_alarms += 1
            print(f"{name} trial {trial + 1}: named {named}", flush=True)
        rows.append((name, world, expected, detected, false_alarms, cpu, at, windows))
    return rows


if __name__ == "__main__":
    main()
