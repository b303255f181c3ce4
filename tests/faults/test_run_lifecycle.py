"""Runs that never lose work: extend, shorten, change, fork, overwrite, corrupt (issue 8).

Real `scaletrain train` commands in one process each (--nproc 1: no launcher, a few
seconds a run) on a tiny IDX dataset: 400 samples, batch 10, so an epoch is 40 steps.
Every refusal is checked to leave the run directory exactly as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.testing import launcher_free_env, write_fake_mnist

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _train(out: Path, data: Path, *extra: str) -> tuple[int, str]:
    args = [
        sys.executable, "-m", "scaletrain", "train", "--nproc", "1", "--data-dir", str(data),
        "--out", str(out), "--batch-size", "10", "--log-every", "5", "--eval-batches", "1",
        "--hang-timeout", "0", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        args, cwd=out.parent, env=launcher_free_env(), capture_output=True, text=True, timeout=200
    )
    return done.returncode, done.stdout + done.stderr


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory with its bytes: what a refused start must not change."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("data"), n_train=400, n_test=20, seed=5)


@pytest.mark.parametrize(
    ("schedule", "warmup"),
    [("cosine", "100"), ("constant", "5")],
    ids=["inside-warmup", "constant"],
)
def test_extending_20_to_40_equals_a_straight_40(
    data: Path, tmp_path: Path, schedule: str, warmup: str
) -> None:
    """Point 1: the schedule is rebuilt from the config; where the learning rates of the
    first 20 steps do not depend on the run's length, the weights are bitwise equal."""
    lr = ["--schedule", schedule, "--warmup", warmup, "--save-every", "10"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    code, log = _train(run, data, "--max-steps", "20", *lr)
    assert code == 0, log
    code, log = _train(run, data, "--max-steps", "40", *lr)
    assert code == 0, log
    assert "resumed at step 20, extending to 40" in log
    code, log = _train(straight, data, "--max-steps", "40", *lr)
    assert code == 0, log
    assert _same_weights(run, straight)
    steps = [r["steps"] for r in _records(run) if r["event"] == "summary"]
    assert steps == [20, 40]


def test_cosine_decay_depends_on_the_length(data: Path, tmp_path: Path) -> None:
    """What the README says: past the warm-up, cosine's first 20 steps differ between a
    20- and a 40-step run, so an extended run is not a straight one (and is allowed)."""
    lr = ["--warmup", "5", "--save-every", "10"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    assert _train(run, data, "--max-steps", "20", *lr)[0] == 0
    code, log = _train(run, data, "--max-steps", "40", *lr)
    assert code == 0 and "extending to 40" in log, log
    assert _train(straight, data, "--max-steps", "40", *lr)[0] == 0
    assert not _same_weights(run, straight)


def test_more_epochs_extend_and_fewer_steps_than_done_stop(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, log = _train(run, data, "--epochs", "1", "--save-every", "20", "--stop-after", "30")
    assert code == 0, log
    code, log = _train(run, data, "--epochs", "2", "--save-every", "20", "--stop-after", "20")
    assert code == 0, log
    assert "resumed at step 30, extending to 80 (it was 40)" in log
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "30", "--save-every", "20")
    assert code == 2, log
    assert "resumes at step 50" in log and "past the 30 steps that --max-steps 30" in log
    assert "--fork NEW_RUN" in log and "Traceback" not in log
    assert _snapshot(run) == before  # config.json included: not overwritten


def test_a_change_of_meaning_is_refused_with_a_table(data: Path, tmp_path: Path) -> None:
    """Point 2: --batch-size 20 on resume (it halves the lr mid-run today) is refused."""
    run = tmp_path / "run"
    assert _train(run, data, "--max-steps", "10", "--save-every", "5", "--stop-after", "5")[0] == 0
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "10", "--batch-size", "20", "--seed", "3")
    assert code == 2, log
    assert "would change what the run means" in log
    lines = log.splitlines()
    assert any(line.split() == ["--batch-size", "10", "20"] for line in lines), log
    assert any(line.split() == ["--seed", "0", "3"] for line in lines), log
    assert "--batch-size 10, --seed 0" in log and "--fork NEW_RUN" in log
    assert _snapshot(run) == before
    # What only changes how it is watched or saved is fine.
    code, log = _train(run, data, "--max-steps", "10", "--log-every", "2", "--keep", "1")
    assert code == 0 and "checkpoints/step-000005 at step 5/10" in log, log


def test_fork_starts_a_new_run_from_the_weights(data: Path, tmp_path: Path) -> None:
    run, fork = tmp_path / "run", tmp_path / "fork"
    assert _train(run, data, "--max-steps", "10", "--save-every", "10")[0] == 0
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "6", "--batch-size", "20", "--fork", str(fork))
    assert code == 0, log
    assert f"forked from {run}/checkpoints/step-000010: its weights, from step 0" in log
    assert _snapshot(run) == before
    assert json.loads((fork / "config.json").read_text())["batch_size"] == 20
    assert [r["steps"] for r in _records(fork) if r["event"] == "summary"] == [6]
    # A fork never writes into a run.
    code, log = _train(run, data, "--max-steps", "6", "--fork", str(fork))
    assert code == 2 and "already holds a run" in log and "--overwrite" in log, log
    # ... and needs a checkpoint to start from.
    code, log = _train(fork, data, "--max-steps", "6", "--fork", str(tmp_path / "other"))
    assert code == 2 and "but it holds none" in log and "--save-every" in log, log
    assert not (tmp_path / "other").exists()


def test_every_checkpoint_corrupt_stops_and_deletes_nothing(data: Path, tmp_path: Path) -> None:
    """Point 3: it used to start from step 0 and prune the old checkpoints."""
    run = tmp_path / "run"
    assert (
        _train(run, data, "--max-steps", "30", "--save-every", "10", "--stop-after", "30")[0] == 0
    )
    for ckpt in (run / "checkpoints").iterdir():
        optimizer = ckpt / "optimizer.pt"
        optimizer.write_bytes(optimizer.read_bytes()[:100])
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "40", "--save-every", "10", "--keep", "1")
    assert code == 2, log
    assert "holds 3 checkpoint(s) and none of them can be loaded" in log
    for step in (10, 20, 30):
        assert f"step-0000{step}: " in log
    assert log.count("optimizer.pt is truncated") == 3
    assert _snapshot(run) == before


def test_a_corrupt_newest_checkpoint_falls_back_saying_why(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        _train(run, data, "--max-steps", "30", "--save-every", "10", "--stop-after", "30")[0] == 0
    )
    newest = run / "checkpoints" / "step-000030" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:-10])
    code, log = _train(run, data, "--max-steps", "40", "--save-every", "10", "--keep", "2")
    assert code == 0, log
    assert "skipped" in log and "step-000030" in log and "model.pt is truncated" in log
    assert "resumed at step 20, extending to 40" in log
    # keep 2: only what is older than two valid checkpoints this run wrote is gone.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000030",
        "step-000040",
    ]


def test_a_finished_run_is_not_trained_over(data: Path, tmp_path: Path) -> None:
    """Point 4: without checkpoints, the same command replaced model.pt and added a
    second summary; pids/ stayed behind."""
    run = tmp_path / "run"
    assert _train(run, data, "--max-steps", "5")[0] == 0
    assert not (run / "pids").exists()
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "5")
    assert code == 2, log
    assert "holds a finished run" in log and "--overwrite" in log
    assert _snapshot(run) == before
    code, log = _train(run, data, "--max-steps", "5", "--overwrite")
    assert code == 0, log
    assert "replaced the run" in log
    assert [r["event"] for r in _records(run)].count("summary") == 1
    # With checkpoints, the same length is finished too: nothing to train.
    assert _train(run, data, "--max-steps", "5", "--save-every", "5", "--overwrite")[0] == 0
    code, log = _train(run, data, "--max-steps", "5", "--save-every", "5")
    assert code == 2 and "already finished at step 5 of 5" in log, log


def test_an_interrupted_start_is_found_and_said(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 3}\n')
    code, log = _train(run, data, "--max-steps", "5")
    assert code == 0, log
    assert "interrupted before its first checkpoint" in log
    assert (run / "metrics.interrupted-1.jsonl").read_text() == '{"event": "train", "step": 3}\n'
    assert [r["step"] for r in _records(run) if r["event"] == "train"] == [5]


def test_resume_at_another_world_size_shares_the_rest_of_the_epoch(
    data: Path, tmp_path: Path
) -> None:
    """Point 5, end to end: 2 ranks stop 7 steps into the epoch (140 of 400 samples seen);
    3 ranks deal the other 260 (86 each, 8 batches of 10) and finish the epoch in 8 steps.
    It used to refuse: "saved mid-epoch by 2 ranks ... this job has 3"."""
    run = tmp_path / "run"
    code, log = _train(run, data, "--nproc", "2", "--epochs", "1", "--stop-after", "7")
    assert code == 0 and "stopped at step 7/20" in log, log
    code, log = _train(run, data, "--nproc", "3", "--epochs", "1")
    assert code == 0, log
    assert "resumed at step 7, shortening to 15 (it was 20)" in log
    assert "data-parallel size 2 -> 3" in log and "batch 10/replica x 3" in log
    assert [r["steps"] for r in _records(run) if r["event"] == "summary"] == [15]
    assert [r["step"] for r in _records(run) if r["event"] == "train"][-1] == 15
