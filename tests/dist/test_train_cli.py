"""`scaletrain train` end to end: the launcher starts 2 Gloo ranks on a small IDX dataset.

The commands run in this process (tests/inprocess.py), the launcher among them (its
ranks are processes all the same): a process start costs more than what they check. The
run whose standard output is closed is a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.testing import launcher_free_env, write_fake_mnist
from scaletrain.train import ConvNet
from tests.inprocess import run_cli

pytestmark = pytest.mark.timeout(240)


def test_train_two_processes_end_to_end(tmp_path: Path) -> None:
    data = write_fake_mnist(tmp_path / "data", n_train=400, n_test=90, seed=1)
    run = tmp_path / "run"
    done = run_cli(
        "train", "--nproc", "2", "--max-steps", "8", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(run), "--log-every", "4",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "2 processes x gloo on cpu" in out
    assert "val_acc" in out and "samples/s" in out and "test accuracy" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds.count("train") == 2 and kinds.count("eval") == 1 and kinds[-1] == "summary"
    summary = records[-1]
    assert summary["world_size"] == 2 and summary["steps"] == 8
    # Evaluation reduced over both ranks counts each of the 90 test samples once.
    assert next(r for r in records if r["event"] == "eval")["count"] == 90
    # The learnable fake data is learnt a little in 8 steps.
    assert summary["val_acc"] > 0.2
    state = torch.load(run / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    ConvNet().load_state_dict(state)


def test_train_single_process_without_launcher(tmp_path: Path) -> None:
    data = write_fake_mnist(tmp_path / "data", n_train=120, n_test=30, seed=2)
    done = run_cli(
        "train", "--nproc", "1", "--epochs", "2", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(tmp_path / "run"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 process x" in done.stdout
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Both epochs train: 120 samples / batch 20 = 6 steps each.
    assert [r["step"] for r in records if r["event"] == "eval"] == [6, 12]
    assert records[-1]["steps"] == 12


def test_train_truncated_dataset_names_the_file(tmp_path: Path) -> None:
    data = write_fake_mnist(tmp_path / "data", n_train=50, n_test=10, seed=2, gz=False)
    images = data / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])
    done = run_cli(
        "train", "--nproc", "1", "--data-dir", str(data), "--out", str(tmp_path / "r"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(images) in done.stderr
    assert "Traceback" not in done.stderr


def test_train_unknown_strategy_is_a_clear_error(tmp_path: Path) -> None:
    done = run_cli("train", "--nproc", "1", "--strategy", "warp-drive", cwd=tmp_path)
    assert done.returncode == 2
    assert "warp-drive" in done.stderr and "ddp" in done.stderr
    assert "Traceback" not in done.stderr


def test_checkpoint_latest_and_consolidate_commands(tmp_path: Path) -> None:
    data = write_fake_mnist(tmp_path / "data", n_train=80, n_test=20, seed=4)
    run = tmp_path / "run"
    done = run_cli(
        "train", "--nproc", "1", "--max-steps", "3", "--batch-size", "20", "--save-every", "2",
        "--data-dir", str(data), "--out", str(run),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    latest = run_cli("checkpoint", "latest", str(run), cwd=tmp_path)
    assert latest.returncode == 0 and latest.stdout.strip().endswith("step-000003")
    out = tmp_path / "plain.pt"
    done = run_cli("checkpoint", "consolidate", str(run), str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    ConvNet().load_state_dict(state)
    final = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(state[k], final[k]) for k in final)
    empty = run_cli("checkpoint", "latest", str(tmp_path / "data"), cwd=tmp_path)
    assert empty.returncode == 2
    assert "no complete, valid checkpoint" in empty.stderr
    # It says what the path is (issue 8): a dataset, not a run.
    assert "is not a run directory (it holds t10k-images-idx3-ubyte" in empty.stderr


def test_train_mesh_that_does_not_fit_nproc_fails_before_starting(tmp_path: Path) -> None:
    done = run_cli("train", "--nproc", "2", "--mesh", "dp=2,tp=2", cwd=tmp_path)
    assert done.returncode == 2
    assert "world size 2" in done.stderr and "4 ranks" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


def test_a_long_evaluation_is_progress_not_a_hang(tmp_path: Path) -> None:
    # 24,000 test samples (12 batches of 1,000 per rank): the evaluation takes several
    # times the hang timeout, but every batch beats the watchdog, so the run finishes.
    data = write_fake_mnist(tmp_path / "data", n_train=80, n_test=24000, seed=5)
    done = run_cli(
        "train", "--nproc", "2", "--max-steps", "2", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(tmp_path / "run"), "--hang-timeout", "1.5",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "run" / "hang").exists()


@pytest.mark.parametrize("nproc", ["2", "1"])
def test_a_closed_stdout_loses_the_output_not_the_run(tmp_path: Path, nproc: str) -> None:
    """issue 26: `scaletrain train ... | head -3` ended the run at its next progress line
    (exit 1, no checkpoint, the launcher's "Decorate ... with @record" advice)."""
    data = write_fake_mnist(tmp_path / "data", n_train=400, n_test=40, seed=4)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "train", "--nproc", nproc, "--max-steps", "24",
         "--batch-size", "10", "--log-every", "1", "--save-every", "8",
         "--data-dir", str(data), "--out", str(run)],
        cwd=tmp_path,
        env=launcher_free_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()  # what `head -3` does after its third line
        err = proc.stderr.read()
        code = proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert head[0].startswith("scaletrain train: recipe convnet"), head
    assert code == 0, err
    assert err.count("standard output was closed") == 1, err
    for noise in ("Traceback", "@record", "error"):
        assert noise not in err, err
    # Trained to the end: every checkpoint, the model and the summary.
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step-000024"
    assert (run / "model.pt").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "summary" and records[-1]["steps"] == 24
