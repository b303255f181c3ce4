"""`scaletrain plan` on a real GPU: the model timed back to back and weighed by CUDA's
allocator (plan/meter.py), the plan of one GPU, and `plan --check` of a GPU run against
its CUDA peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_the_meter_times_and_weighs_on_the_gpu() -> None:
    from scaletrain.plan.meter import Peak, in_turns, median_time

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(2048, 2048, device=dev)
    peak = Peak(dev)
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    grown = peak.growth()
    del big
    assert grown is not None and grown >= 64 * 2**20
    # cuBLAS's workspace, allocated by this process's first product and kept for its
    # life, is counted where a stretch multiplies: a run's peak holds it, whatever ran
    # before the plan in the plan's process.
    small = torch.randn(16, 16, device=dev)
    small @ small
    peak = Peak(dev)
    small @ small
    grown = peak.growth()
    assert grown is not None and grown >= 2**20
    _, wall = median_time(lambda: a @ a, 3, dev)
    times = in_turns({"one": lambda: a @ a, "four": lambda: [a @ a for _ in range(4)]}, 3, dev)
    # Back to back, four products take about four times one (the GPU's time, not the
    # host's queueing of them), and the two timers agree.
    assert 2.5 < times["four"] / times["one"] < 6
    assert 0.5 < wall / times["one"] < 2


def test_one_gpu_is_planned_on_the_gpu_and_a_run_checked_by_cuda_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import scaletrain as st
    from scaletrain import cli

    p = st.plan("convnet", devices=1, batch_size=64)
    assert p.hardware.name == "this-gpu" and p.hardware.cores is None
    row = p.rows[0]
    assert row.fits and row.memory.total > p.profile.param_bytes
    assert any("calibrated on this GPU" in a for a in p.assumptions)
    assert 0 < row.time.total < 1.0
    run = tmp_path / "run"
    code = cli.main(
        ["train", "--recipe", "split-net", "--nproc", "1", "--max-steps", "30",
         "--ledger-every", "10", "--eval-batches", "0", "--out", str(run)]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    assert cli.main(["plan", "--check", str(run)]) == 0
    out = capsys.readouterr().out
    assert "CUDA peak allocated" in out and "ms measured (" in out
    from scaletrain.train.planning import check_run

    check = check_run(run)
    assert check.allocated and check.memory_error is not None
    assert abs(check.memory_error) < 10 and abs(check.step_error) < 50
