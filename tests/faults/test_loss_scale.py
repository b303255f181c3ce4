"""fp16-mixed's loss scaling is part of the run: a resume continues its scale, and
pipeline stages skip an overflowing step together.

fp16-mixed needs a CUDA GPU, so these tests give the runtime's Precision a CPU
GradScaler under "32" (the same object fp16-mixed makes on a GPU, and the same
scale/step/update calls): powers of two scale and unscale float32 exactly, so the
runs train as without one, and what is checked is the scaler's own bookkeeping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain import cli
from scaletrain.testing import run_ranks, write_fake_mnist

pytestmark = pytest.mark.timeout(240)

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3
"""Clean steps before the scale doubles: a run of 8 steps grows it twice, and one
stopped at 4 is in the middle of a count."""


def _with_a_cpu_scaler() -> None:
    """Every Precision made from here on carries a CPU GradScaler."""
    from scaletrain import precision

    made = precision.Precision.__post_init__

    def with_scaler(self: Any) -> None:
        made(self)
        self.scaler = torch.amp.GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
        )

    precision.Precision.__post_init__ = with_scaler  # type: ignore[method-assign]


def _loss_scale(run: Path) -> dict[str, Any]:
    last = sorted((run / "checkpoints").iterdir())[-1]
    values = json.loads((last / "values.json").read_text())
    return dict(values["loss_scale"])


def test_a_resumed_run_continues_its_loss_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scale and its count of clean steps were not saved: a run resumed at step 4
    started over from the initial scale and grew it on another schedule than the run
    that never stopped (under fp16, steps one took the other skips for overflow)."""
    from scaletrain import precision

    monkeypatch.setattr(precision.Precision, "__post_init__", precision.Precision.__post_init__)
    _with_a_cpu_scaler()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = write_fake_mnist(tmp_path / "data", n_train=200, n_test=20)

    def train(out: Path, *extra: str, steps: int = 8) -> None:
        args = ["train", "--nproc", "1", "--data-dir", str(data), "--batch-size", "20",
                "--max-steps", str(steps), "--eval-batches", "0", "--out", str(out),
                *extra]  # fmt: skip
        assert cli.main(args) == 0

    train(tmp_path / "whole")
    train(tmp_path / "stopped", "--stop-after", "4")
    train(tmp_path / "stopped")
    whole, resumed = _loss_scale(tmp_path / "whole"), _loss_scale(tmp_path / "stopped")
    assert whole["scale"] == INIT_SCALE * 2 ** (8 // GROWTH_INTERVAL)
    assert resumed == whole
    # A fork that takes the optimizer's state takes the scale with it: one more clean
    # step completes the whole run's count (8 % 3 + 1 = 3) and doubles it.
    train(tmp_path / "whole", "--fork", str(tmp_path / "fork"), "--fork-optimizer", steps=1)
    assert _loss_scale(tmp_path / "fork")["scale"] == whole["scale"] * 2


def _one_stage_overflows(fused: bool) -> dict[str, Any]:
    _with_a_cpu_scaler()
    import scaletrain as st
    from scaletrain.strategies.pipeline import Pipeline

    rt = st.init(strategy=Pipeline(microbatches=2))
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, fused=fused))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    rt.forward_backward(model, x, y, nn.functional.cross_entropy)
    mine = [p for p in bare.parameters() if p.grad is not None]
    if rt.rank == 0:  # this stage's gradients overflowed; the other stage's did not
        mine[0].grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in mine]
    rt.step(opt)
    result = {
        "stepped": [not torch.equal(p, b) for p, b in zip(mine, before, strict=True)],
        "scale": rt.precision.scaler.get_scale(),
    }
    rt.shutdown()
    return result


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_pipeline_stages_skip_an_overflowing_step_together(fused: bool) -> None:
    """Each stage's GradScaler checked only its own gradients: the stage that overflowed
    skipped the step and halved its scale, the other stepped with its gradients and kept
    its scale, and from then on the stages trained apart. A fused optimizer checks
    inside its own step, where no group is asked."""
    results = run_ranks(_one_stage_overflows, 2, fused, timeout=200)
    for rank, got in enumerate(results):
        assert got["stepped"] and not any(got["stepped"]), rank
        assert got["scale"] == INIT_SCALE / 2, rank


@pytest.mark.gpu
def test_fp16_mixed_resumes_its_loss_scale_on_a_gpu(tmp_path: Path) -> None:
    """The same as on the CPU above, with the GradScaler fp16-mixed makes itself."""
    data = write_fake_mnist(tmp_path / "data", n_train=400, n_test=20)

    def train(out: Path, *extra: str) -> None:
        args = ["train", "--nproc", "1", "--data-dir", str(data), "--batch-size", "20",
                "--precision", "fp16-mixed", "--max-steps", "12", "--eval-batches", "0",
                "--out", str(out), *extra]  # fmt: skip
        assert cli.main(args) == 0

    train(tmp_path / "whole")
    train(tmp_path / "stopped", "--stop-after", "5")
    train(tmp_path / "stopped")
    assert _loss_scale(tmp_path / "stopped") == _loss_scale(tmp_path / "whole")
