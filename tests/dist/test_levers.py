"""Activation checkpointing and torch.compile under every strategy, at 2 real Gloo ranks.

Each lever is equal to its absence where the math allows: checkpointing recomputes
the same ops on the same inputs, so losses, gradient norms and weights are bitwise
those of no checkpointing (CPU, float32); compile rounds differently, so it is
within a stated tolerance of eager over 20 steps.

Compile here uses the "aot_eager" backend: the same capture as inductor (dynamo
through the checkpoints, tensor parallel's DTensors and FSDP's hooks, AOT
autograd's joint graph), without code generation, which costs about a minute
of C++ compilation per process on a 2-core machine. Inductor itself is tested
in one process (tests/unit/test_levers.py); SCALETRAIN_TEST_COMPILE=inductor
runs this sweep with it.

One launch per strategy trains every variant in turn (fresh model each time): the
strategy's fields are read when rt.setup() wraps the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.testing import launcher_free_env, run_ranks
from scaletrain.train.models import GPT, GPTConfig
from tests.inprocess import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
STEPS = 20
"""Steps of the eager and the compiled runs (compile's differences grow with steps)."""
AC_STEPS = 3
"""Steps of the checkpointed runs: bitwise equal to the eager run's first steps."""
PER_REPLICA = 4

BACKEND = os.environ.get("SCALETRAIN_TEST_COMPILE", "aot_eager")

VARIANTS: list[tuple[str, int | None, bool | str]] = [
    ("none", None, False),
    ("full", None, False),
    ("selective", None, False),
    ("selective", 2, False),
    ("selective", None, BACKEND),
]

COMPILE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
"""Losses (and gradient norms), compiled vs eager over 20 AdamW steps (float32, lr
1e-3): inductor's fused kernels sum in another order, and the differences grow a
little with every step."""
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 5e-5}
"""Weights after those 20 steps: Adam's normalised updates carry a rounding
difference whole into a weight near zero (inductor under tensor parallel: 1.2e-5 in
one of 4,096)."""


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _train(strategy: Any, mesh: dict[str, int] | None, cache: str) -> list[dict[str, Any]]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import scaletrain as st

    rt = st.init(strategy=strategy, mesh=mesh)
    out = []
    for ac, every, compiled in VARIANTS:
        strat = rt.strategy
        strat.ac, strat.ac_every, strat.compile = ac, every, compiled
        torch.manual_seed(0)
        bare = GPT(SMALL)
        model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
        g = torch.Generator().manual_seed(11)
        losses = []
        early: dict[str, torch.Tensor] = {}
        for step in range(AC_STEPS if ac != "none" and not compiled else STEPS):
            tokens = torch.randint(
                0, SMALL.vocab_size, (rt.dp_size, PER_REPLICA, SMALL.block_size + 1), generator=g
            )[rt.dp_rank]
            opt.zero_grad()
            loss = rt.forward_backward(model, tokens[:, :-1], tokens[:, 1:], _loss)
            norm = rt.clip_grad_norm(model, opt, max_norm=1e9)  # measures, does not clip
            opt.step()
            losses.append((float(loss), float(norm)))
            if step + 1 == AC_STEPS:
                early = rt.full_state_dict(model)
        weights = rt.full_state_dict(model)
        out.append(
            {
                "variant": (ac, every, compiled),
                "losses": losses,
                "early": early,
                "weights": weights,
                "keys": sorted(weights),
            }
        )
    rt.shutdown()
    return out


def _check(per_rank: list[list[dict[str, Any]]]) -> None:
    for runs in per_rank:
        base = runs[0]
        assert base["variant"] == ("none", None, False)
        for run in runs[1:]:
            compiled = run["variant"][2]
            # Checkpoint keys stay the user's: no wrapper prefix from either lever.
            assert run["keys"] == base["keys"], run["variant"]
            if not compiled:
                assert run["losses"] == base["losses"][:AC_STEPS], run["variant"]
                for name, value in base["early"].items():
                    assert torch.equal(run["weights"][name], value), (run["variant"], name)
            else:
                got, eager = torch.tensor(run["losses"]), torch.tensor(base["losses"])
                torch.testing.assert_close(got, eager, **COMPILE_TOLERANCE)
                for name, value in base["weights"].items():
                    torch.testing.assert_close(run["weights"][name], value, **WEIGHT_TOLERANCE)


@pytest.mark.parametrize(
    ("strategy", "mesh"),
    [
        ("ddp", None),
        ("fsdp", None),
        ("tensor", None),
        ("pipeline", None),
        ("fsdp", {"dp": 1, "tp": 2}),
    ],
    ids=["ddp", "fsdp", "tensor", "pipeline", "fsdp-x-tp"],
)
def test_checkpointing_is_bitwise_and_compile_within_tolerance(
    strategy: str, mesh: dict[str, int] | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache = str(tmp_path_factory.getbasetemp() / "inductor-cache")
    _check(run_ranks(_train, 2, strategy, mesh, cache, timeout=400))


def test_the_docs_commands_train_with_checkpointing_and_compile(tmp_path: Path) -> None:
    """The two commands of the docs' large-models section. The first (2 FSDP processes, op-level selective
    checkpointing) shortened to 3 steps. The second (full checkpointing and inductor
    compile, 20 steps) in one process (2 processes cost a minute of C++ compilation
    each here) beside the same command without --compile: every step's loss within
    COMPILE_TOLERANCE; the compile time is the ledger's own phase, not step time, and
    the run's samples/s leaves it out."""
    from tests.docblocks import commands

    first, second = commands("levers")
    assert first[:2] == ["scaletrain", "train"] and "--ac" in first and "--compile" in second
    assert second[second.index("--max-steps") + 1] == str(STEPS)
    quiet = ["--log-every", "1", "--eval-batches", "0", "--no-save-last"]
    env = {**launcher_free_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run(words: list[str], *extra: str, here: bool = False) -> str:
        if here:  # in this process (tests/inprocess.py): its launcher's or its own
            done = run_cli(*words[1:], *quiet, *extra, cwd=tmp_path, env=env)
        else:
            done = subprocess.run(
                [sys.executable, "-m", "scaletrain", *words[1:], *quiet, *extra],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False,
            )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    header = run(first, "--max-steps", "3", "--out", str(tmp_path / "selective"), here=True)
    # The run's header names its levers (it named precision and accumulation, not these).
    assert "activation checkpointing selective" in _strategy_line(header), header
    config = json.loads((tmp_path / "selective" / "config.json").read_text())
    assert (config["ac"], config["compile"]) == ("selective", False)

    # The compiled run in a process of its own: inductor's state stays there.
    said = run(second, "--out", str(tmp_path / "compiled"), "--nproc", "1")
    assert "activation checkpointing full, compiled" in _strategy_line(said), said
    eager = [w for w in second if w != "--compile"]
    run(eager, "--out", str(tmp_path / "eager"), "--nproc", "1", here=True)

    def records(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    losses = {
        name: torch.tensor([r["loss"] for r in records(name) if r["event"] == "train"])
        for name in ("compiled", "eager")
    }
    assert len(losses["eager"]) == STEPS
    torch.testing.assert_close(losses["compiled"], losses["eager"], **COMPILE_TOLERANCE)
    assert "torch.compile: " in said and "left out of the step times" in said, said
    summary = records("compiled")[-1]
    assert 0 < summary["compile_time_s"] < summary["train_time_s"]
    assert summary["samples_per_s"] > STEPS * 32 / summary["train_time_s"]
    assert f"({summary['compile_time_s']:.1f} s of it compiling)" in said


def _pipeline_statistics(ac: str) -> dict[str, torch.Tensor]:
    import scaletrain as st
    from scaletrain.strategies.pipeline import Pipeline
    from scaletrain.train.models import ConvNet

    rt = st.init(strategy=Pipeline(microbatches=2, ac=ac))
    torch.manual_seed(0)
    bare = ConvNet()
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        rt.forward_backward(model, x, y, nn.functional.cross_entropy)
        opt.step()
    state = rt.full_state_dict(model)
    rt.shutdown()
    return {k: v for k, v in state.items() if "running" in k or "batches" in k}


def test_a_checkpointed_pipeline_stage_updates_batchnorms_statistics_once() -> None:
    """A pipeline stage is a traced graph, checkpointed whole: no BatchNorm module is
    left in it, only its buffers, and the recomputation updated them a second time."""
    plain = run_ranks(_pipeline_statistics, 2, "none", timeout=150)
    checkpointed = run_ranks(_pipeline_statistics, 2, "full", timeout=150)
    for got, want in zip(checkpointed, plain, strict=True):
        assert want and got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def _strategy_line(output: str) -> str:
    """The header's second line: "  strategy ddp, 2 processes x gloo on cpu, ..."."""
    return next((line for line in output.splitlines() if line.startswith("  strategy ")), "")
