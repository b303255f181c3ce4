"""What the step ledger costs: the ConvNet and the gpt recipe under DDP, ledger on vs off.

Each round starts 2 Gloo ranks (one thread each) twice per model: once with the ledger
off (SCALETRAIN_LEDGER=0: no hooks at all) and once on (hooks, a window gather every
K=50 steps and at steps 10 and 20, records written to disk). Rounds alternate on/off so
machine noise hits both alike. Each rank times its own steps with perf_counter (after
opt.step() returns) and process CPU time; the first 10 steps are warm-up. Reported:
medians over rounds of the per-round median step, their ratio, CPU ms per step.

A last round per model records a profile window (steps 40-45): its steps' median
against the same run's steps outside it is the window's own cost, reported apart.

    .venv/bin/python benchmarks/observe_overhead.py --rounds 7 --steps 150
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

WARMUP = 10


def _job(model_name: str, steps: int, out: str | None, profile: str | None) -> dict[str, Any]:
    import torch
    from torch import nn

    import scaletrain as st
    from scaletrain.train.recipes import get_recipe

    rt = st.init(strategy="ddp", ledger=st.LedgerConfig(out=out, summary=False))
    torch.manual_seed(0)
    recipe = get_recipe(model_name)
    bare = recipe.build()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01, momentum=0.9))
    batch = 32 if model_name == "gpt" else 100
    n = (steps + 1) * batch * rt.world_size
    if model_name == "gpt":
        tokens = torch.randint(0, 256, (n, 65))
        data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    else:
        data = torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    loader = rt.loader(data, batch_size=batch, drop_last=True)
    if profile:
        rt.profile(profile)
    walls: list[float] = []
    cpus: list[float] = []
    last, last_cpu = time.perf_counter(), time.process_time()
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        x, y = x.to(rt.device), y.to(rt.device)
        loss = recipe.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.any_rank(False)  # scaletrain train's per-step stop agreement
        now, cpu = time.perf_counter(), time.process_time()
        walls.append(now - last)
        cpus.append(cpu - last_cpu)
        last, last_cpu = now, cpu
    del model, opt
    rt.shutdown()
    _ = nn
    return {"walls": walls, "cpus": cpus}


def _round(model: str, steps: int, ledger: bool, profile: str | None = None) -> dict[str, Any]:
    from scaletrain.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = tmp if ledger else None
        results = run_ranks(
            _job, 2, model, steps, out, profile,
            env={"SCALETRAIN_LEDGER": "1" if ledger else "0"}, timeout=900,
        )  # fmt: skip
    return results[0]


def _hook_cost(steps: int, repeats: int) -> tuple[float, float]:
    """The ledger's own cost per step, in one process, without noise from peers: a tiny
    model (so the cost is visible) with and without the ledger's hooks, alternating."""
    import torch
    from torch import nn

    from scaletrain.observe.metrics.hooks import watch_loader, watch_module, watch_optimizer
    from scaletrain.observe.metrics.ledger import LedgerConfig, StepLedger

    class Batches:
        def __init__(self, n: int) -> None:
            self.x, self.y = torch.randn(n, 8, 16), torch.randint(0, 4, (n, 8))

        def __iter__(self) -> Any:
            return zip(self.x, self.y, strict=True)

    def run(hooked: bool) -> float:
        torch.manual_seed(0)
        model = nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = Batches(steps)
        if hooked:
            with tempfile.TemporaryDirectory() as tmp:
                ledger = StepLedger(LedgerConfig(out=tmp, every=50, flops=False, summary=False))
                watch_module(ledger, model)
                watch_optimizer(ledger, opt)
                watch_loader(ledger, batches)
                start = time.perf_counter()
                _loop(model, opt, batches)
                elapsed = time.perf_counter() - start
                ledger.finish(collective=False)
                return elapsed / steps
        start = time.perf_counter()
        _loop(model, opt, batches)
        return (time.perf_counter() - start) / steps

    off, on = [], []
    for i in range(repeats):
        for hooked in (False, True) if i % 2 == 0 else (True, False):
            (on if hooked else off).append(run(hooked))
    return statistics.median(off), statistics.median(on)


def _loop(model: Any, opt: Any, batches: Any) -> None:
    import torch

    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--models", default="convnet,gpt")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        per = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            for ledger in order:
                r = _round(model, args.steps, ledger)
                key = "on" if ledger else "off"
                per[key].append(statistics.median(r["walls"][WARMUP:]))
                per[key + "_cpu"].append(statistics.median(r["cpus"][WARMUP:]))
            print(
                f"{model} round {i + 1}/{args.rounds}: off {per['off'][-1] * 1e3:.2f} ms, "
                f"on {per['on'][-1] * 1e3:.2f} ms",
                flush=True,
            )
        p = _round(model, args.steps, True, profile="40-45")
        inside = statistics.median(p["walls"][39:45])
        outside = statistics.median(p["walls"][WARMUP:38] + p["walls"][47:])
        rows.append((model, per, inside, outside))
    hook_off, hook_on = _hook_cost(2000, 9)
    load = os.getloadavg()
    print(
        f"\n2 ranks x 1 thread, Gloo, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"{time.strftime('%Y-%m-%d')}, {args.rounds} rounds x {args.steps} steps"
    )
    print(
        "| model | step ms, off | step ms, on | on/off | paired on/off | CPU ms/step, off "
        "| CPU ms/step, on | on/off |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, per, _, _ in rows:
        off, on = statistics.median(per["off"]), statistics.median(per["on"])
        coff, con = statistics.median(per["off_cpu"]), statistics.median(per["on_cpu"])
        # Rounds ran on and off back to back: the median of their ratios cancels the
        # drift between rounds (other load on the machine).
        paired = statistics.median(a / b for a, b in zip(per["on"], per["off"], strict=True))
        print(
            f"| {model} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | {paired:.3f} | "
            f"{coff * 1e3:.2f} | {con * 1e3:.2f} | {con / coff:.3f} |"
        )
    print(
        "\nThe ledger's own cost per step (one process, a 16x4 Linear, 2000 steps, 9 "
        "alternating repeats):"
    )
    print("| step us, no ledger | step us, ledger | ledger us per step |")
    print("|---:|---:|---:|")
    print(f"| {hook_off * 1e6:.1f} | {hook_on * 1e6:.1f} | {(hook_on - hook_off) * 1e6:.1f} |")
    print("\nProfile window (steps 40-45, torch.profiler on every rank), same run:")
    print("| model | step ms outside | step ms inside | inside/outside |")
    print("|---|---:|---:|---:|")
    for model, _, inside, outside in rows:
        print(f"| {model} | {outside * 1e3:.2f} | {inside * 1e3:.2f} | {inside / outside:.2f} |")


if __name__ == "__main__":
    main()
