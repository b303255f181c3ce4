"""Runs that stop, die or are preempted end with the same weights as uninterrupted ones.

Real `scaletrain train` commands (2 Gloo ranks through the launcher) on small IDX
data written by the test; the launcher runs in this process (tests/inprocess.py) where
the test does not signal or kill it. Every comparison is bitwise: resuming restores
weights, optimizer, scheduler, sampler position and RNG exactly, and with 2 ranks
DDP's gradient sum a + b is the same whatever order the buckets arrive in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scaletrain.testing import launcher_free_env, write_fake_mnist
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EXIT_PREEMPTED = 75


def _args(out: Path, data: Path, *extra: str, recipe: str = "convnet") -> list[str]:
    # The gpt recipe reads its own corpus (Python's sources), not the IDX files.
    source = ["--data-dir", str(data)] if recipe != "gpt" else []
    return [
        "train", "--nproc", "2", "--recipe", recipe, *source, "--out", str(out),
        "--batch-size", "20", "--log-every", "1", "--epochs", "2", "--hang-timeout", "60",
        *extra,
    ]  # fmt: skip


def _start(out: Path, data: Path, *extra: str, recipe: str = "convnet") -> subprocess.Popen[str]:
    """The command in a process of its own: for the tests that signal or kill it."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *_args(out, data, *extra, recipe=recipe)],
        cwd=out.parent,
        env=launcher_free_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(out: Path, data: Path, *extra: str, recipe: str = "convnet") -> tuple[int, str]:
    """The command run to its end with its launcher in this process (tests/inprocess.py):
    its ranks are processes all the same, but not the launcher's import of torch."""
    done = run_cli(*_args(out, data, *extra, recipe=recipe), cwd=out.parent)
    return done.returncode, done.stdout + done.stderr


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stdout + stderr


def _train_losses(out: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # A resumed run appends; a step logged twice (before a crash, again after the
    # restart) must have the same loss both times.
    losses: dict[int, float] = {}
    for r in records:
        if r["event"] == "train":
            assert losses.setdefault(r["step"], r["loss"]) == r["loss"], r
    return losses


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def _assert_same_run(a: Path, b: Path) -> None:
    assert _train_losses(a) == _train_losses(b)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {path} appeared:\n{_finish(proc)[1]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 1200 samples, batch 20 x 2 ranks: 30 steps per epoch, 60 in all; long enough
    # after the step-4 checkpoint for a kill or a signal to land mid-run.
    return write_fake_mnist(tmp_path_factory.mktemp("data"), n_train=1200, n_test=60, seed=3)


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    code, log = _run(out, data, "--save-every", "4")
    assert code == 0, log
    assert max(_train_losses(out)) == 60
    return out


def test_stop_mid_epoch_and_resume_is_bitwise_identical(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    code, log = _run(out, data, "--save-every", "4", "--stop-after", "7")
    assert code == 0, log
    assert "stopped at step 7/60" in log  # step 7 of 30 in epoch 1: mid-epoch
    assert not (out / "model.pt").exists()
    code, log = _run(out, data, "--save-every", "4")
    assert code == 0, log
    assert "resumed from" in log and "step-000007" in log
    _assert_same_run(reference, out)


def test_killed_worker_restarts_resumes_and_matches(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = _start(out, data, "--save-every", "4", "--max-restarts", "2")
    _wait_for(out / "checkpoints" / "step-000004" / "manifest.json", proc)
    victim = int((out / "pids" / "rank1.pid").read_text())
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        pytest.skip("the run finished before the kill (machine too fast)")
    code, log = _finish(proc)
    assert code == 0, log
    assert "resumed from" in log
    # The workers' pid files go when they exit (issue 8: pids/ is removed at exit).
    assert not (out / "pids").exists()
    _assert_same_run(reference, out)


def test_sigterm_saves_exits_75_and_a_later_start_resumes(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = _start(out, data, "--save-every", "4")
    _wait_for(out / "checkpoints" / "step-000004" / "manifest.json", proc)
    # What SLURM does before a preemption: signal every task of the job step.
    for rank in (0, 1):
        try:
            os.kill(int((out / "pids" / f"rank{rank}.pid").read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pytest.skip("the run finished before the signal (machine too fast)")
    code, log = _finish(proc)
    if code == 0:
        pytest.skip("the run finished before the signal arrived (machine too fast)")
    assert code == EXIT_PREEMPTED, log
    assert "stopped at step" in log and "signal SIGTERM" in log
    code, log = _run(out, data, "--save-every", "4")
    assert code == 0, log
    assert "resumed from" in log
    _assert_same_run(reference, out)


SHARDED = {"fsdp": "convnet", "pipeline": "convnet", "tensor": "gpt"}
"""Each sharded strategy and the recipe it trains."""


def _sharded_flags(strategy: str) -> list[str]:
    extra = ["--strategy", strategy, "--max-steps", "8", "--batch-size", "8", "--save-every", "4"]
    # Evaluation is not compared; the gpt recipe's whole test split would cost each of
    # its runs many seconds on a 2-core machine. FSDP's runs evaluate nothing: nothing
    # that could make the ranks' BatchNorm statistics equal (its reference run is also
    # test_fsdp_model_pt_and_the_consolidated_checkpoint_agree's).
    return [*extra, "--eval-batches", "0" if strategy == "fsdp" else "2"]


@pytest.fixture(scope="module")
def sharded_reference(
    data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The uninterrupted 8-step run of a sharded strategy, trained once for the module."""
    made: dict[str, Path] = {}

    def reference_of(strategy: str) -> Path:
        if strategy not in made:
            out = tmp_path_factory.mktemp(f"ref-{strategy}") / "run"
            code, log = _run(out, data, *_sharded_flags(strategy), recipe=SHARDED[strategy])
            assert code == 0, log
            made[strategy] = out
        return made[strategy]

    return reference_of


@pytest.mark.parametrize(("strategy", "recipe"), list(SHARDED.items()))
def test_every_sharded_strategy_resumes_bitwise(
    strategy: str,
    recipe: str,
    data: Path,
    tmp_path: Path,
    sharded_reference: Callable[[str], Path],
) -> None:
    """Sharded checkpoints (DCP): FSDP keeps each rank's BatchNorm statistics, a
    pipeline rank saves only its stages, tensor parallel its shards."""
    extra = _sharded_flags(strategy)
    ref, run = sharded_reference(strategy), tmp_path / "run"
    code, log = _run(run, data, *extra, "--stop-after", "5", recipe=recipe)
    assert code == 0, log
    code, log = _run(run, data, *extra, recipe=recipe)
    assert code == 0, log
    assert "resumed from" in log
    _assert_same_run(ref, run)


def test_evaluating_changes_nothing_a_run_saves(data: Path, tmp_path: Path) -> None:
    """Evaluation reads the model (data-parallel replica 0's BatchNorm statistics) and
    changes no rank's own: a run's model.pt and checkpoints are the same whether and
    when it evaluated, and an extended run equals a straight one."""
    base = ["--max-steps", "20", "--save-every", "5"]
    quiet, extended = tmp_path / "quiet", tmp_path / "extended"
    code, log = _run(quiet, data, *base, "--eval-batches", "0")
    assert code == 0, log
    # 10 steps, evaluated at their end, then extended to 20 and evaluated again at the
    # end: an evaluation a straight run never made, and the one every run makes last.
    code, log = _run(extended, data, *base[2:], "--max-steps", "10", "--eval-batches", "1")
    assert code == 0, log
    code, log = _run(extended, data, *base, "--eval-batches", "1")
    assert code == 0, log
    assert "resumed at step 10, extending to 20" in log
    assert [r["event"] for r in _records(extended)].count("eval") == 2
    _assert_same_run(quiet, extended)
    for step in ("step-000010", "step-000015", "step-000020"):
        a = torch.load(quiet / "checkpoints" / step / "model.pt", weights_only=True)
        b = torch.load(extended / "checkpoints" / step / "model.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), step


def test_fsdp_model_pt_and_the_consolidated_checkpoint_agree(
    tmp_path: Path, sharded_reference: Callable[[str], Path]
) -> None:
    """Under FSDP each rank keeps its own BatchNorm statistics; model.pt and the last
    checkpoint's consolidated model both hold replica 0's (a resume restores each
    rank's own: test_every_sharded_strategy_resumes_bitwise)."""
    out = sharded_reference("fsdp")  # evaluates nothing, which could make them equal
    consolidated = tmp_path / "consolidated.pt"
    proc = run_cli(  # in this process (tests/inprocess.py)
        "checkpoint", "consolidate", str(out / "checkpoints" / "step-000008"), str(consolidated)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model_pt, whole = _weights(out), torch.load(consolidated, weights_only=True)
    assert model_pt.keys() == whole.keys()
    for name in model_pt:
        assert torch.equal(model_pt[name], whole[name]), name
