"""Training throughput: scaletrain against the seeds' raw-PyTorch DDP script, side by side.

Runs, alternately and on the same data and machine, each of:
  raw         torchrun ... examples/ddp_raw.py          (hand-written DDP)
  twin        torchrun ... examples/ddp_scaletrain.py   (same loop on scaletrain's API)
  train       scaletrain train                          (the Trainer, as `make train` runs it)
and prints the median training samples/s of each and its ratio to raw.

    .venv/bin/python benchmarks/ddp_throughput.py --nproc 2 --max-steps 300 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _torchrun(nproc: int, script: str, steps: int) -> float:
    out = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", script, "--max-steps", str(steps), "--epochs", "100"]
    )  # fmt: skip
    match = re.search(r"train samples/s: ([0-9.]+)", out)
    if not match:
        sys.exit(f"no throughput line in the output of {script}:\n{out}")
    return float(match.group(1))


def _scaletrain_train(nproc: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            [sys.executable, "-m", "scaletrain", "train", "--nproc", str(nproc),
             "--max-steps", str(steps), "--epochs", "100", "--out", tmp]
        )  # fmt: skip
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        summary = json.loads(lines[-1])
        return float(summary["samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"raw": [], "twin": [], "train": []}
    for i in range(args.repeats):
        runs["raw"].append(_torchrun(args.nproc, "examples/ddp_raw.py", args.max_steps))
        runs["twin"].append(_torchrun(args.nproc, "examples/ddp_scaletrain.py", args.max_steps))
        runs["train"].append(_scaletrain_train(args.nproc, args.max_steps))
        print(
            f"repeat {i + 1}/{args.repeats}: "
            + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in runs.items()),
            flush=True,
        )
    base = statistics.median(runs["raw"])
    print(
        f"\n{args.nproc} processes, {args.max_steps} steps of batch 100/rank, median of {args.repeats}"
    )
    print(f"| {'run':<6} | {'samples/s (median)':>18} | {'min':>8} | {'max':>8} | {'vs raw':>6} |")
    print(f"|{'-' * 8}|{'-' * 20}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
    for name, values in runs.items():
        med = statistics.median(values)
        print(
            f"| {name:<6} | {med:>18,.0f} | {min(values):>8,.0f} | {max(values):>8,.0f} | {med / base:>6.3f} |"
        )


if __name__ == "__main__":
    main()
