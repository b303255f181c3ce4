"""How right `scaletrain plan` is on one GPU, and what it says of 8 and 64 H100s.

Part 1, this machine's GPU (1 process), for the convnet and gpt recipes, each round:
`scaletrain plan`'s own calibration in a fresh process (the model's step and the
runtime's, timed back to back, and the memory CUDA's allocator adds), then a fresh
process trains --steps steps with the step ledger on, and what `plan --check RUN`
reads is read back: the median training work per step and the CUDA peak allocated.

Part 2, the gpt recipe scaled to ~1B parameters (GPT_1B below, bf16-mixed, batch 8 of
1024 tokens): trained on this GPU for a few steps (step time, CUDA peak, MFU from the
ledger's FLOPs against the datasheet), beside the h100-sxm profile's paper plan for
one device; then the paper plans of 8 and 64 H100s (predictions, nothing measured).

    python benchmarks/plan_gpu.py --rounds 2 --steps 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = (
    ("convnet", 128, "32"),
    ("gpt", 32, "32"),
    ("gpt", 32, "bf16-mixed"),
    ("gpt", 32, "bf16-true"),
)
"""(recipe, batch, precision) measured on this GPU."""


def _steps(rt: Any, model: Any, opt: Any, batch: Any, loss: Any, steps: int) -> None:
    """`steps` training steps of one batch on the runtime's device, then shutdown."""
    x, y = (t.to(rt.device) for t in batch)
    rt.prepare(model, x)
    for _ in range(steps):
        rt.forward_backward(model, x, y, loss)
        rt.step(opt)
        opt.zero_grad(set_to_none=True)
    rt.shutdown()


def _train(recipe_name: str, batch: int, precision: str, steps: int, out: str) -> None:
    import scaletrain as st
    from scaletrain.train.recipes import get_recipe

    recipe = get_recipe(recipe_name)
    ledger = st.LedgerConfig(out=out, every=10, flops=False, summary=False)
    rt = st.init(strategy="ddp", ledger=ledger, precision=precision)
    torch.manual_seed(0)
    bare = recipe.build()
    model, opt = rt.setup(bare, recipe.optimizer(bare.parameters(), 1e-3))
    _steps(rt, model, opt, recipe.example(batch), recipe.loss, steps)


def _measure(recipe: str, batch: int, precision: str, steps: int) -> tuple[float, int | None]:
    from scaletrain.train.planning import measured, measured_allocated

    with tempfile.TemporaryDirectory() as tmp, _fresh() as pool:
        pool.submit(_train, recipe, batch, precision, steps, tmp).result()
        step, _, _ = measured(tmp)
        return step, measured_allocated(tmp)


def _plan_row(recipe: str, batch: int, precision: str) -> Any:
    from scaletrain.train.planning import plan

    return plan(recipe, devices=1, batch_size=batch, precision=precision).rows[0]


def _fresh() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))


def _pct(pred: float, meas: float | None) -> str:
    return "n/a" if not meas else f"{(pred - meas) / meas * 100:+.1f}"


def part1(rounds: int, steps: int) -> None:
    res: dict[tuple[str, int, str], dict[str, list[float]]] = {
        c: {"pt": [], "mt": [], "pm": [], "mm": []} for c in CONFIGS
    }
    for r in range(rounds):
        for c in CONFIGS:
            with _fresh() as pool:
                row = pool.submit(_plan_row, *c).result()
            mt, mm = _measure(*c, steps)
            res[c]["pt"].append(row.time.total)
            res[c]["pm"].append(row.memory.total)
            res[c]["mt"].append(mt)
            if mm:
                res[c]["mm"].append(mm)
            print(f"round {r} {c}: step {row.time.total * 1e3:.2f}/{mt * 1e3:.2f} ms, CUDA peak "
                  f"{row.memory.total / 2**20:.1f}/{(mm or 0) / 2**20:.1f} MiB", flush=True)  # fmt: skip
    med = statistics.median
    print("\n| recipe | batch | precision | step ms pred | step ms meas | err % | meas min-max "
          "| CUDA peak MiB pred | CUDA peak MiB meas | err % |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in CONFIGS:
        x = res[c]
        pt, mt, pm = med(x["pt"]), med(x["mt"]), med(x["pm"])
        mm = med(x["mm"]) if x["mm"] else None
        print(f"| {c[0]} | {c[1]} | {c[2]} | {pt * 1e3:.2f} | {mt * 1e3:.2f} | {_pct(pt, mt)} | "
              f"{min(x['mt']) * 1e3:.2f}-{max(x['mt']) * 1e3:.2f} | {pm / 2**20:.1f} | "
              f"{(mm or 0) / 2**20:.1f} | {_pct(pm, mm)} |")  # fmt: skip


def _train_1b(steps: int, out: str) -> None:
    import gpt_1b

    import scaletrain as st

    ledger = st.LedgerConfig(out=out, every=5, flops=True, summary=True)
    rt = st.init(strategy="ddp", ledger=ledger, precision="bf16-mixed")
    torch.manual_seed(0)
    with torch.device(rt.device):
        bare = gpt_1b.build()  # initialised on the GPU: seconds, not minutes
    model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-4))
    _steps(rt, model, opt, gpt_1b.example(gpt_1b.BATCH), gpt_1b.loss, steps)


def _paper(devices: int, mfu: float | None = None) -> Any:
    import gpt_1b

    import scaletrain as st

    return st.plan(model="gpt_1b:build", devices=devices, hardware="h100-sxm",
                   batch_size=gpt_1b.BATCH, precision="bf16-mixed", mfu=mfu)  # fmt: skip


def part2(steps: int) -> None:
    import gpt_1b

    from scaletrain.observe.records import read_run
    from scaletrain.train.planning import measured, measured_allocated

    first = _paper(1)
    one = first.rows[0]
    params = first.profile.param_bytes / 4 / 1e9
    print(f"\ngpt_1b: {params:.2f}B parameters, batch {gpt_1b.BATCH} x "
          f"{gpt_1b.CFG.block_size} tokens, bf16-mixed, AdamW")  # fmt: skip
    mfu = None
    if torch.cuda.is_available():
        with tempfile.TemporaryDirectory() as tmp:
            with _fresh() as pool:
                pool.submit(_train_1b, steps, tmp).result()
            step, _, _ = measured(tmp)
            peak = measured_allocated(tmp)
            summary = read_run(tmp).summary or {}
        mfu = (summary.get("mfu") or {}).get("datasheet")
        print(f"| | step ms | CUDA peak MiB | MFU |\n|---|---:|---:|---:|\n"
              f"| measured, this GPU ({torch.cuda.get_device_name()}) | {step * 1e3:.1f} | "
              f"{(peak or 0) / 2**20:.0f} | {'n/a' if mfu is None else f'{mfu:.1%}'} |\n"
              f"| paper plan, 1 x h100-sxm (40% of peak assumed) | {one.time.total * 1e3:.1f} | "
              f"{one.memory.total / 2**20:.0f} | 40% |\n"
              f"| error of the paper plan % | {_pct(one.time.total, step)} | "
              f"{_pct(one.memory.total, peak)} | |")  # fmt: skip
    for n in (8, 64):
        for m in (None, mfu) if mfu else (None,):
            p = _paper(n, m)
            what = (f"at the MFU measured on this GPU, {m:.1%}" if m
                    else "at the profile's assumed 40% of peak")  # fmt: skip
            print(f"\nPREDICTION (on paper, nothing measured at this size): {n} x H100, {what}\n")
            print(p.table() if m or not mfu else f"recommended: {p.reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--steps-1b", type=int, default=15)
    ap.add_argument("--part", choices=("1", "2", "all"), default="all")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ["PYTHONPATH"]]
    )  # the spawned processes import gpt_1b too
    start = time.time()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"{platform.node()}, {gpu}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)  # fmt: skip
    if args.part in ("1", "all"):
        if not torch.cuda.is_available():
            print("part 1 needs a GPU: skipped")
        else:
            part1(args.rounds, args.steps)
    if args.part in ("2", "all"):
        part2(args.steps_1b)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
