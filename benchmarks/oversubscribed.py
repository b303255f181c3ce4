"""Where a tensor-parallel rank's time goes with more processes than cores.

What was the planner's worst CPU row (`plan_accuracy.py`): the gpt recipe (batch 8)
under tensor parallel at 4 Gloo processes on a 2-core machine, predicted 20-23% short
in every run until its probe timed the tensor-parallel step among the ranks (what this
found: the work between the collectives runs slower, not the collectives). This puts a real run's step beside its skeleton: the same 24 all-reduces
of the same size (the activations of a rowwise layer, or the input gradient of a
colwise one: batch x block x embedding, fp32) in the same 4 processes, with pieces
of work between them that take a fixed amount of CPU (`--work` ms per step, small
matrix products, timed by the thread's own CPU clock so that waiting for a core does
not shorten them).

Per rank and step it prints the process's user and system CPU, its voluntary and
forced context switches, its main thread's CPU (the work, and the collectives' share
of it that runs in the calling thread) and the wall time. Where the skeleton's system
CPU and switches match the real step's, its collectives cost what the real ones do;
what differs is then the work between them.

    .venv/bin/python benchmarks/oversubscribed.py --rounds 2 --work 31
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from typing import Any

import torch

BATCH = 8
ALL_REDUCES = 24
"""The gpt recipe's tensor-parallel step: 8 rowwise outputs, 16 colwise input gradients."""


def _usage() -> tuple[float, ...]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (
        r.ru_utime,
        r.ru_stime,
        r.ru_nvcsw,
        r.ru_nivcsw,
        time.thread_time(),
        time.perf_counter(),
    )


def _per_step(before: tuple[float, ...], after: tuple[float, ...], steps: int) -> list[float]:
    return [(b - a) / steps for a, b in zip(before, after, strict=True)]


def _timed(step: Any, steps: int) -> list[float]:
    import torch.distributed as dist

    for _ in range(5):
        step()
    dist.barrier()
    before = _usage()
    for _ in range(steps):
        step()
    return _per_step(before, _usage(), steps)


def _real(steps: int, recipe_name: str = "gpt", strategy: str = "tensor") -> list[float]:
    import scaletrain as st
    from scaletrain.train.recipes import get_recipe

    recipe = get_recipe(recipe_name)
    rt = st.init(strategy=strategy)
    torch.manual_seed(0)
    bare = recipe.build()
    model, opt = rt.setup(bare, recipe.optimizer(bare.parameters(), 1e-3))
    x, y = recipe.example(BATCH if recipe_name == "gpt" else 32)
    rt.prepare(model, x)

    def step() -> None:
        rt.forward_backward(model, x, y, recipe.loss)
        rt.step(opt)
        opt.zero_grad(set_to_none=True)

    out = _timed(step, steps)
    rt.shutdown()
    return out


def _skeleton(work: float, numel: int, steps: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    a = torch.ones(32, 32)
    buf = torch.ones(numel)
    piece = work / (ALL_REDUCES + 1)

    def spend() -> None:
        end = time.thread_time() + piece
        while time.thread_time() < end:
            torch.mm(a, a)

    def step() -> None:
        for _ in range(ALL_REDUCES):
            spend()
            dist.all_reduce(buf)
        spend()

    return _timed(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--work", type=float, default=31.0, help="skeleton's CPU ms of work a step")
    ap.add_argument(
        "--also", default="", metavar="RECIPE:STRATEGY,...",
        help="other real steps at 4 processes to put beside them, e.g. gpt:fsdp,convnet:ddp",
    )  # fmt: skip
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    from scaletrain.testing import run_ranks
    from scaletrain.train.recipes import get_recipe

    recipe = get_recipe("gpt")
    tokens, _ = recipe.example(BATCH)
    with torch.device("meta"):
        width = recipe.build().tok_emb.weight.shape[1]
    numel = tokens.numel() * width  # batch x block x embedding
    rows: list[tuple[str, list[float]]] = []
    also = [tuple(x.split(":")) for x in args.also.split(",") if x]
    for _ in range(args.rounds):
        for name, fn, fargs in (
            ("real gpt tensor", _real, (args.steps,)),
            (f"skeleton, {args.work:.0f} ms work", _skeleton, (args.work / 1e3, numel, args.steps)),
            *((f"real {r} {s}", _real, (args.steps, r, s)) for r, s in also),
        ):
            ranks = run_ranks(fn, 4, *fargs, timeout=600)
            rows.append((name, [statistics.median(r[i] for r in ranks) for i in range(6)]))
            print(f"{name}: done", flush=True)
    print(
        f"\n{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians over the 4 ranks\n"
    )
    print(
        "| step | user ms | sys ms | voluntary switches | forced switches | main thread CPU ms | wall ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (user, system, vol, forced, main_cpu, wall) in rows:
        print(
            f"| {name} | {user * 1e3:.1f} | {system * 1e3:.1f} | {vol:.0f} | {forced:.0f} "
            f"| {main_cpu * 1e3:.1f} | {wall * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
