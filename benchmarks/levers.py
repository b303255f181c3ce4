"""Activation checkpointing, torch.compile and float8, side by side: peak memory and step time.

Trains the llama recipe's model (RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention) in one process through the library (`st.init(strategy=st.SingleDevice(
ac=..., compile=...))`), once per setting, each in a fresh process so that its
peak memory is its own:

- on a GPU: CUDA peak allocated bytes, step time, tokens/s and MFU from the step
  ledger (compiling steps are left out of both by the ledger);
- on a CPU: the growth of the process's peak resident memory from the end of
  setup to the end of training (activations, gradients and optimizer state; with
  glibc's mmap threshold fixed, so freed tensors leave the RSS), and the median step
  time of the steps after the first `--warmup` (compile happens in those).

    python benchmarks/levers.py                          # CPU: a size that stresses 2 cores
    python benchmarks/levers.py --size 1b --precision bf16-mixed --batch 4 --seq 2048
                                                         # one GPU (benchmarks/gpu_session.sh)
    python benchmarks/levers.py --set float8 --size 1b --precision bf16-mixed --batch 4 \
        --seq 2048                                       # compiled, with and without float8
                                                         # (a GPU of compute capability 8.9+)

Prints a table in the format of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

SETTINGS = [
    ("none", None, False, False),
    ("selective", None, False, False),
    ("selective", 2, False, False),
    ("full", None, False, False),
    ("none", None, True, False),
    ("selective", None, True, False),
    ("full", None, True, False),
]
"""--set levers (the default): (ac, ac_every, compile, float8) of each row."""

FLOAT8_SETTINGS = [
    ("none", None, True, False),
    ("none", None, True, True),
]
"""--set float8: compiled, without and with float8 (float8 is fast only compiled)."""


def _label(ac: str, every: int | None, compiled: bool, float8: bool = False) -> str:
    name = f"{ac} every {every}" if every else ac
    name = f"{name} + compile" if compiled else name
    return f"{name} + float8" if float8 else name


def one(args: argparse.Namespace) -> dict[str, Any]:
    """Train one setting in this process; return its measurements."""
    import torch
    from torch import nn

    import scaletrain as st
    from scaletrain.train.models import LLAMA_SHAPES, Llama

    torch.manual_seed(0)
    shape = LLAMA_SHAPES[args.size]
    changes = {
        k: v
        for k, v in (("dim", args.dim), ("n_layers", args.layers), ("n_heads", args.heads))
        if v is not None
    }
    if args.kv_heads is not None:
        changes["n_kv_heads"] = args.kv_heads
    shape = replace(shape, max_seq_len=max(shape.max_seq_len, args.seq), **changes)
    out = tempfile.mkdtemp(prefix="levers-")
    strategy = st.SingleDevice(
        ac=args.ac, ac_every=args.every, compile=args.compile, float8=args.float8
    )
    rt = st.init(
        strategy=strategy,
        precision=args.precision,
        ledger=st.LedgerConfig(out=out, every=max(args.steps // 2, 1)),
    )
    model = Llama(shape)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=rt.device.type == "cuda")
    model, opt = rt.setup(model, opt)
    g = torch.Generator().manual_seed(1)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    cuda = rt.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, shape.vocab_size, (args.batch, args.seq + 1), generator=g)
        x, y = tokens[:, :-1].to(rt.device), tokens[:, 1:].to(rt.device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        rt.forward_backward(model, x, y, loss_fn)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_setup
    )
    rt.shutdown()
    summary = json.loads((Path(out) / "observe" / "summary.json").read_text())
    kept = times[args.warmup :]
    step = statistics.median(kept)
    return {
        "setting": _label(args.ac, args.every, args.compile, args.float8),
        "params": params,
        "step_s": step,
        "tokens_s": args.batch * args.seq / step,
        "peak_bytes": peak,
        "mfu": summary.get("mfu"),
        "compile_s": (summary.get("compile") or {}).get("seconds"),
        "device": str(rt.device),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="debug", help="a llama recipe size: debug, 1b, 8b")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="32")
    p.add_argument(
        "--set",
        choices=("levers", "float8"),
        default="levers",
        help="levers: each checkpointing mode with and without compile; float8: compiled, "
        "with and without float8",
    )
    p.add_argument("--only", default=None, help="comma-separated setting numbers (0-based)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ac", default="none", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--float8", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.size != "debug":
        # The named size as it is, unless a dimension is given explicitly.
        for name in ("dim", "layers", "heads", "kv_heads"):
            if f"--{name.replace('_', '-')}" not in sys.argv:
                setattr(args, name, None)
    if args.one:
        print("RESULT " + json.dumps(one(args)))
        return
    table = FLOAT8_SETTINGS if args.set == "float8" else SETTINGS
    chosen = table if args.only is None else [table[int(i)] for i in args.only.split(",")]
    shared = [a for a in sys.argv[1:] if not a.startswith("--only")]
    if "--only" in sys.argv:
        i = sys.argv.index("--only")
        shared = sys.argv[1:i] + sys.argv[i + 2 :]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        # glibc serves large blocks from mmap, returned at free, only below a threshold
        # it raises as blocks are freed; past it, freed activations stay in the heap
        # and the peak RSS no longer follows the live tensors. A fixed threshold keeps
        # every tensor-sized block on mmap.
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    rows = []
    for ac, every, compiled, float8 in chosen:
        cmd = [sys.executable, __file__, "--one", *shared, "--ac", ac]
        cmd += ["--every", str(every)] if every else []
        cmd += ["--compile"] if compiled else []
        cmd += ["--float8"] if float8 else []
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{_label(ac, every, compiled, float8)}: failed\n{done.stdout}{done.stderr}")
            continue
        rows.append(json.loads(line[len("RESULT ") :]))
        print(f"# {rows[-1]['setting']}: done", file=sys.stderr)
    if not rows:
        return
    base = rows[0]
    cuda = base["device"].startswith("cuda")
    memory = "CUDA peak allocated" if cuda else "peak RSS growth"
    print(
        f"\n{base['params'] / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
        f"precision {args.precision}, {base['device']}\n"
    )
    print(f"| setting | step | tokens/s | {memory} | vs none | MFU | compile |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if cuda and r["mfu"] else "-"
        comp = f"{r['compile_s']:.0f} s" if r["compile_s"] else "-"
        print(
            f"| {r['setting']} | {r['step_s'] * 1e3:,.0f} ms | {r['tokens_s']:,.0f} | "
            f"{r['peak_bytes'] / 2**20:,.0f} MiB | {r['peak_bytes'] / base['peak_bytes']:.2f} | "
            f"{mfu} | {comp} |"
        )


if __name__ == "__main__":
    main()
