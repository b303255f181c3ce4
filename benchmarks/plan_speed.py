"""How long `scaletrain plan` takes to profile a model, and what the cycle collector costs.

A plan's time is its profiles: one fake-tensor forward, backward and optimizer step per
precision kind (planner/profile.py). Python's cycle collector runs only at block
boundaries there, a full collection each time (`_between_blocks`), over the objects
the profile makes: what the process held before it is frozen (gc.freeze). The
baseline freezes nothing, as the planner did before, so each collection walks every
object the process holds. Both run here side by side, alternating, each model
`--repeat` times (the fastest is kept), and every profile field a plan reads is
compared between the two: freezing is a cost, never a different answer.

    python benchmarks/plan_speed.py            # about 3 minutes on 2 cores

Prints a table in the format of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import scaletrain.planner.profile as profile
from scaletrain.planner.models import resolve_model

HF_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
    "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4,
    "num_hidden_layers": 8, "vocab_size": 8000, "max_position_embeddings": 1024,
}  # fmt: skip
"""A small Llama config.json (8 blocks), planned as a user's model is."""

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("llama recipe", {"recipe": "llama"}, "bf16-mixed", "selective"),
    ("gpt recipe", {"recipe": "gpt"}, "32", "full"),
    ("llama-1b recipe, 2 x 1024 tokens", {"recipe": "llama-1b", "seq_len": 1024}, "bf16-mixed",
     "selective"),
    ("HF Llama config.json, 8 blocks", {"model": "HF"}, "bf16-mixed", "full"),
]  # fmt: skip


def _answer(p: profile.ModelProfile) -> dict[str, Any]:
    """What a plan reads of a profile."""
    fields = asdict(p)
    fields["modules"] = {k: asdict(v) for k, v in p.modules.items()}
    return fields


def _timed(planned: Any, precision: str, ac: str, base: bool) -> tuple[float, dict[str, Any]]:
    """Seconds and answer of one profile; `base`: the baseline, nothing frozen (as where
    the caller froze objects of its own, which the profile then leaves as they are)."""
    shipped = gc.get_freeze_count
    if base:
        gc.get_freeze_count = lambda: 1
    try:
        start = time.perf_counter()
        p = profile.profile_model(
            planned.build, planned.example(2), planned.loss, planned.optimizer,
            precision=precision, ac=ac, name=planned.name,
        )  # fmt: skip
        return time.perf_counter() - start, _answer(p)
    finally:
        gc.get_freeze_count = shipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each (the fastest kept)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: runs of each, 1 or more (e.g. --repeat 2)")
    folder = Path(tempfile.mkdtemp(prefix="plan-speed-"))
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    rows = []
    for name, spec, precision, ac in CASES:
        model = str(folder) if spec.get("model") == "HF" else None
        planned = resolve_model(spec.get("recipe"), model, seq_len=spec.get("seq_len"))
        _timed(planned, precision, ac, base=False)  # warm: torch's first-call caches
        times: dict[bool, list[float]] = {True: [], False: []}
        answers = []
        for _ in range(args.repeat):
            for frozen_nothing in (True, False):
                seconds, answer = _timed(planned, precision, ac, frozen_nothing)
                times[frozen_nothing].append(seconds)
                answers.append(answer)
        same = all(a == answers[0] for a in answers[1:])
        base, now = min(times[True]), min(times[False])
        rows.append((name, precision, ac, base, now, base / now, same))
        print(f"  {name}: {base:.1f} s -> {now:.1f} s", file=sys.stderr, flush=True)
    print("| model | precision | AC | nothing frozen s | the process frozen s | speedup | "
          "same profile |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---|")
    for name, precision, ac, base, now, ratio, same in rows:
        print(f"| {name} | {precision} | {ac} | {base:.2f} | {now:.2f} | {ratio:.2f}x | "
              f"{'yes' if same else 'NO'} |")  # fmt: skip
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
