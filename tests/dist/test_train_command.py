"""`scaletrain train` as a new user meets it: real processes, real output.

What can only be seen by running the command: which processes start, what a failure
inside the workers prints, what a short trial learns, what a run writes down. The
one-process runs run in this process, as the command runs them (tests/inprocess.py):
a process start costs more than their few steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.testing import launcher_free_env, write_fake_mnist
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        cwd=cwd,
        env=launcher_free_env(),
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )


def _records(run: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["dp", "model-parallel"])
def test_single_process_strategies_run_in_one_process_by_default(
    tmp_path: Path, strategy: str
) -> None:
    done = run_cli(
        "train", "--strategy", strategy, "--recipe", "split-net", "--max-steps", "3",
        "--eval-batches", "1", "--out", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"strategy {strategy}, 1 process x gloo" in done.stdout


def test_a_failure_inside_the_workers_is_printed_once(tmp_path: Path) -> None:
    # The files are there (the parent's check passes) but truncated: only reading them,
    # in the workers, finds out. Both ranks fail; the user reads it once.
    data = write_fake_mnist(tmp_path / "data", n_train=60, n_test=10, seed=2, gz=False)
    images = data / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])
    done = _scaletrain(
        "train", "--nproc", "2", "--data-dir", str(data), "--out", str(tmp_path / "run"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert err.count(str(images)) == 1, err
    assert err.startswith("scaletrain: error on rank "), err
    for noise in ("Traceback", "torch.distributed.elastic", "@record", "ChildFailedError",
                  "Sending process", "scaletrain launch: worker"):  # fmt: skip
        assert noise not in err, err


def test_a_short_trial_learns_and_writes_what_it_used(tmp_path: Path) -> None:
    # The trial: `--max-steps 20` with every default (2 processes, real
    # Fashion-MNIST). It must end below where it started.
    run = tmp_path / "run"
    done = _scaletrain(
        "train", "--max-steps", "20", "--log-every", "1", "--eval-batches", "1",
        "--out", str(run), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data: /usr/share/datasets/fashion-mnist" in done.stdout
    assert "this 20-step run ends inside it" in done.stdout
    records = _records(run)
    losses = [float(r["loss"]) for r in records if r["event"] == "train"]  # type: ignore[arg-type]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert all(isinstance(r["time"], float) for r in records)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["count"] for r in evals] == [2 * 1000]  # --eval-batches 1: one batch per rank
    config = json.loads((run / "config.json").read_text())
    # Every default filled in: the file reproduces the run.
    for key, value in {
        "recipe": "convnet", "nproc": 2, "batch_size": 100, "lr": 0.1, "epochs": 2,
        "warmup": 100, "schedule": "cosine", "backend": "gloo", "sync_bn": False,
        "eval_batch_size": 1000, "data_dir": "/usr/share/datasets/fashion-mnist",
        "out": str(run), "max_steps": 20,
    }.items():  # fmt: skip
        assert config[key] == value, key
    assert config["run"]["world_size"] == 2
    assert set(config["run"]["versions"]) == {"scaletrain", "torch", "python"}


def test_a_runs_config_json_replays_it(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    done = run_cli(
        "train", "--recipe", "split-net", "--nproc", "1", "--max-steps", "4",
        "--eval-batches", "0", "--lr", "0.05", "--out", str(first), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "evaluation skipped" in done.stdout
    assert not [r for r in _records(first) if r["event"] == "eval"]
    again = run_cli(
        "train", "--config", str(first / "config.json"), "--out", str(second), cwd=tmp_path
    )
    assert again.returncode == 0, again.stdout + again.stderr
    a = json.loads((first / "config.json").read_text())
    b = json.loads((second / "config.json").read_text())
    assert a.pop("out") == str(first) and b.pop("out") == str(second)
    assert a == b
    losses = [[r["loss"] for r in _records(p) if r["event"] == "train"] for p in (first, second)]
    assert losses[0] == losses[1]


def test_max_steps_past_the_epochs_says_where_the_run_stops(tmp_path: Path) -> None:
    # A model module's default is one epoch: --max-steps 5 on 2 steps an epoch trained
    # 2 steps and said nothing.
    (tmp_path / "tiny.py").write_text(
        "import torch\nfrom torch import nn\nbatch_size = 4\n"
        "def build():\n    return nn.Linear(4, 3)\n"
        "def datasets(split):\n    return [(torch.zeros(4), i % 3) for i in range(8)]\n"
    )
    done = run_cli(
        "train", "--model", "tiny:build", "--nproc", "1", "--max-steps", "5",
        "--out", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 epoch, 2 steps" in done.stdout
    assert (
        "--max-steps 5 is past the end of 1 epoch (2 steps): the run stops at step 2. "
        "For 5, add --epochs 3." in done.stdout
    ), done.stdout
