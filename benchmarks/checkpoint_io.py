"""Checkpoint save/load times: full vs sharded vs async, and how long training is blocked.

Trains the small GPT (n_layer 4, n_embd 128, AdamW) for two steps on N Gloo ranks,
then saves and loads it repeatedly:
  full     DDP model: rank 0 writes plain torch.save files
  sharded  FSDP2 model (fully_shard per block): every rank writes its shards (DCP)
each sync and async. "blocks" is how long save_checkpoint holds the training
thread (for async: until it returns the handle); "complete" is from the call
until the checkpoint's manifest is on disk (async: call + wait(), nothing else
running). "3 steps after save" is the time of three training steps run right
after the call (for async: while the write goes on in the background), against
three steps with no save in flight. Times are medians over the repeats of the
slowest rank; the table is printed in markdown.

    .venv/bin/python benchmarks/checkpoint_io.py --nproc 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

BATCH, STEPS_AFTER = 8, 3


def _model() -> nn.Module:
    from scaletrain.train.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=128))


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 256, (BATCH, 64), generator=g)
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), idx[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def _setup(rt: Any, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    if kind == "full":
        wrapped, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        wrapped = fully_shard(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for _ in range(2):
        _step(wrapped, opt, rt.rank)
    return wrapped, opt


def _steps(rt: Any, model: nn.Module, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    for _ in range(STEPS_AFTER):
        _step(model, opt, rt.rank)
    return time.perf_counter() - t0


def _job(out_dir: str, repeats: int) -> dict[str, list[dict[str, float]]]:
    import scaletrain as st
    from scaletrain.checkpoint import load_checkpoint, save_checkpoint, wait_pending

    rt = st.init(strategy="ddp")
    results: dict[str, list[dict[str, float]]] = {}
    for kind in ("full", "sharded"):
        model, opt = _setup(rt, kind)
        _steps(rt, model, opt)  # warm up
        for mode in ("sync", "async"):
            rows = results.setdefault(f"{kind} {mode}", [])
            for i in range(repeats):
                path = Path(out_dir) / kind / mode / f"step-{i:06d}"
                complete = 0.0
                if mode == "async":
                    # Time to a complete checkpoint, nothing else running.
                    rt.barrier()
                    t0 = time.perf_counter()
                    save_checkpoint(
                        rt, path, async_save=True, model=model, optimizer=opt, step=i
                    ).wait()
                    complete = time.perf_counter() - t0
                rt.barrier()
                t0 = time.perf_counter()
                save_checkpoint(
                    rt, path, keep=1, async_save=mode == "async", model=model, optimizer=opt, step=i
                )
                blocked = time.perf_counter() - t0
                # Training right after the call (for async: while the write goes on).
                during = _steps(rt, model, opt)
                wait_pending()
                rt.barrier()
                baseline = _steps(rt, model, opt)
                rt.barrier()
                size = sum(f.stat().st_size for f in path.iterdir())
                t0 = time.perf_counter()
                load_checkpoint(rt, path, model=model, optimizer=opt)
                load = time.perf_counter() - t0
                rows.append(
                    {
                        "blocked": blocked,
                        "complete": complete or blocked,
                        "load": load,
                        "during": during,
                        "baseline": baseline,
                        "size": size,
                    }
                )
        del model, opt
    rt.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    from scaletrain.testing import run_ranks

    out = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        per_rank = run_ranks(_job, args.nproc, str(out), args.repeats, timeout=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(out, ignore_errors=True)

    def med(row: str, key: str) -> float:
        # The slowest rank sets the pace of a synchronous job.
        return statistics.median(
            max(r[row][i][key] for r in per_rank) for i in range(len(per_rank[0][row]))
        )

    print(
        f"\ncheckpoint I/O, GPT n_layer=4 n_embd=128 + AdamW, world size {args.nproc}, "
        f"torch {torch.__version__}, median of {args.repeats}\n"
    )
    print(
        "| checkpoint     | size MB | save blocks ms | save complete ms | load ms "
        f"| {STEPS_AFTER} steps after save ms | {STEPS_AFTER} steps, no save ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in per_rank[0]:
        print(
            f"| {row:<14} | {med(row, 'size') / 1e6:7.1f} | {1e3 * med(row, 'blocked'):14.1f} "
            f"| {1e3 * med(row, 'complete'):16.1f} | {1e3 * med(row, 'load'):7.1f} "
            f"| {1e3 * med(row, 'during'):8.1f} | {1e3 * med(row, 'baseline'):8.1f} |"
        )


if __name__ == "__main__":
    main()
