"""Runs that never lose work: extend, shorten, change, fork, overwrite, corrupt (issue 8).

Real `scaletrain train` commands (--nproc 1: no launcher), each run in the test's own
process as the command line runs it (tests/inprocess.py), on a tiny IDX dataset: 400
samples, batch 10, so an epoch is 40 steps.
Every refusal is checked to leave the run directory exactly as it was. A run that
several tests start from is trained once (a module fixture) and copied into each test
that changes it: a process start costs more than the run it starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.testing import write_fake_mnist
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _train(out: Path, data: Path, *extra: str) -> tuple[int, str]:
    # In this process (tests/inprocess.py): a process start costs more than the run.
    args = [
        "train", "--nproc", "1", "--data-dir", str(data), "--out", str(out),
        "--batch-size", "10", "--log-every", "5", "--eval-batches", "1", "--hang-timeout", "0",
        *extra,
    ]  # fmt: skip
    done = run_cli(*args, cwd=out.parent)
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


def _copy(run: Path, to: Path) -> Path:
    """A copy of a run directory that a test may change (the module's runs are shared)."""
    shutil.copytree(run, to, symlinks=True)
    return to


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("data"), n_train=400, n_test=20, seed=5)


@pytest.fixture(scope="module")
def ten_steps(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run trained with the defaults for 10 steps (it keeps its last checkpoint), and
    its output."""
    run = tmp_path_factory.mktemp("ten") / "run"
    code, log = _train(run, data, "--max-steps", "10")
    assert code == 0, log
    return run, log


@pytest.fixture(scope="module")
def ten_steps_bare(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 10-step run without checkpoints (--no-save-last): only model.pt."""
    run = tmp_path_factory.mktemp("bare") / "run"
    code, log = _train(run, data, "--max-steps", "10", "--no-save-last")
    assert code == 0, log
    return run


@pytest.fixture(scope="module")
def thirty_steps(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 30-step run with checkpoints at steps 10, 20 and 30."""
    run = tmp_path_factory.mktemp("thirty") / "run"
    code, log = _train(run, data, "--max-steps", "30", "--save-every", "10", "--stop-after", "30")
    assert code == 0, log
    return run


@pytest.fixture(scope="module")
def cosine_extended(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """Cosine past its 5-step warm-up: a 20-step run extended to 40 (and the extension's
    output), and a straight 40-step run."""
    lr = ["--warmup", "5", "--lr", "0.05", "--save-every", "10"]
    root = tmp_path_factory.mktemp("cosine")
    run, straight = root / "run", root / "straight"
    code, log = _train(run, data, "--max-steps", "20", *lr)
    assert code == 0, log
    code, extended = _train(run, data, "--max-steps", "40", *lr)
    assert code == 0 and "extending to 40" in extended, extended
    code, log = _train(straight, data, "--max-steps", "40", *lr)
    assert code == 0, log
    return run, straight, extended


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
    # The closing line's count and time are this start's ("done: 40 steps in" said both).
    assert "done: 20 steps (steps 21-40, resumed at 20) in " in log, log
    # Inside the warm-up, or constant, the rate does not depend on the length: nothing
    # to say about it.
    assert "learning rate at step" not in log, log
    extended = log
    code, log = _train(straight, data, "--max-steps", "40", *lr)
    assert code == 0, log
    assert _same_weights(run, straight)
    summaries = [r for r in _records(run) if r["event"] == "summary"]
    assert [r["steps"] for r in summaries] == [20, 40]
    # The time and pace printed are this start's, not the whole run's (they said the
    # whole run's beside this start's count); summary.json keeps both.
    first, second = summaries
    assert second["start_time_s"] == pytest.approx(second["train_time_s"] - first["train_time_s"])
    pace = f"in {second['start_time_s']:.1f} s, {second['start_samples_per_s']:,.0f} samples/s"
    assert f"resumed at 20) {pace} over " in extended, extended


def test_cosine_decay_depends_on_the_length(cosine_extended: tuple[Path, Path, str]) -> None:
    """What the docs say: past the warm-up, cosine's first 20 steps differ between a
    20- and a 40-step run, so an extended run is not a straight one (and is allowed)."""
    run, straight, _ = cosine_extended
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


def test_fork_starts_a_new_run_from_the_weights(
    data: Path, tmp_path: Path, ten_steps: tuple[Path, str]
) -> None:
    run, fork = _copy(ten_steps[0], tmp_path / "run"), tmp_path / "fork"
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "6", "--batch-size", "20", "--fork", str(fork))
    assert code == 0, log
    assert f"forked from {run}/checkpoints/step-000010: its weights, from step 0" in log
    assert _snapshot(run) == before
    assert json.loads((fork / "config.json").read_text())["batch_size"] == 20
    assert [r["steps"] for r in _records(fork) if r["event"] == "summary"] == [6]
    # A fork records where it came from (issue 26, point 12).
    parent = {"run": str(run), "checkpoint": f"{run}/checkpoints/step-000010", "step": 10}
    recorded = json.loads((fork / "config.json").read_text())["run"]["forked_from"]
    assert recorded == {**parent, "optimizer": False}
    summary = next(r for r in _records(fork) if r["event"] == "summary")
    assert summary["forked_from"] == {**parent, "optimizer": False}
    # A fork never writes into a run.
    code, log = _train(run, data, "--max-steps", "6", "--fork", str(fork))
    assert code == 2 and "already holds a run" in log and "--overwrite" in log, log
    # ... and needs something to start from.
    empty = tmp_path / "empty"
    empty.mkdir()
    code, log = _train(empty, data, "--max-steps", "6", "--fork", str(tmp_path / "other"))
    assert code == 2 and "no checkpoint and no model.pt" in log, log
    assert not (tmp_path / "other").exists()


def test_every_checkpoint_corrupt_stops_and_deletes_nothing(
    data: Path, tmp_path: Path, thirty_steps: Path
) -> None:
    """Point 3: it used to start from step 0 and prune the old checkpoints."""
    run = _copy(thirty_steps, tmp_path / "run")
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


def test_a_corrupt_newest_checkpoint_falls_back_saying_why(
    data: Path, tmp_path: Path, thirty_steps: Path
) -> None:
    run = _copy(thirty_steps, tmp_path / "run")
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


def test_a_finished_run_is_not_trained_over(
    data: Path, tmp_path: Path, ten_steps_bare: Path
) -> None:
    """Point 4: without checkpoints, the same command replaced model.pt and added a
    second summary; pids/ stayed behind."""
    run = _copy(ten_steps_bare, tmp_path / "run")
    assert not (run / "pids").exists()
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "10")
    assert code == 2, log
    assert "holds a finished run" in log and "--overwrite" in log
    assert _snapshot(run) == before
    code, log = _train(run, data, "--max-steps", "5", "--overwrite", "--no-save-last")
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
    # Not "shortening to 15": nobody asked; the same epoch takes fewer steps.
    assert "the run now ends at step 15 (it was 20: the global batch changed" in log, log
    assert "data-parallel size 2 -> 3" in log and "batch 10/replica x 3" in log
    # The RNG notice in the command's voice, not Python's (file, line, source line).
    assert "scaletrain: warning: checkpoint " in log and "were NOT restored" in log, log
    assert "UserWarning" not in log, log
    assert [r["steps"] for r in _records(run) if r["event"] == "summary"] == [15]
    assert [r["step"] for r in _records(run) if r["event"] == "train"][-1] == 15


def _summary(out: Path) -> dict[str, object]:
    return json.loads((out / "observe" / "summary.json").read_text())


def test_stop_after_on_the_last_step_finishes_the_run(data: Path, tmp_path: Path) -> None:
    """Issue 26, point 6: it left the run unfinished (no evaluation, no model.pt, "run
    again to resume"), and the next start printed an empty "mean of 0 steps" table."""
    run = tmp_path / "run"
    code, log = _train(run, data, "--max-steps", "10", "--stop-after", "10")
    assert code == 0, log
    assert (run / "model.pt").is_file() and "done: 10 steps" in log
    assert "resume" not in log
    assert [r["event"] for r in _records(run)].count("eval") == 1
    before = _snapshot(run)
    code, log = _train(run, data, "--max-steps", "10", "--stop-after", "10")
    assert code == 2 and "already finished at step 10 of 10" in log, log
    assert "mean of 0 steps" not in log
    assert _snapshot(run) == before


def test_a_resumed_run_keeps_its_records_mfu_and_step_range(data: Path, tmp_path: Path) -> None:
    """Points 7 and 8: a resumed run lost its MFU, its metrics records fell on other
    steps than a straight run's (12, 17, ... for --log-every 5 after a stop at 7), the
    first averaging a partial window unsaid, and its summary said steps 11-31 for a run
    that ended at 30 (loading the optimizer state ran a step the ledger counted)."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    common = ["--max-steps", "30", "--ledger-every", "5"]
    assert _train(straight, data, *common)[0] == 0
    code, log = _train(run, data, *common, "--stop-after", "7")
    assert code == 0 and "stopped at step 7/30" in log, log
    code, log = _train(run, data, *common)
    assert code == 0, log
    train = [r for r in _records(run) if r["event"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in _records(straight) if r["event"] == "train"] == [
        5,
        10,
        15,
        20,
        25,
        30,
    ]
    # The record at 10 after the resume averages steps 8-10, and says so.
    assert [r["window_steps"] for r in train] == [5, 3, 5, 5, 5, 5]
    summary = _summary(run)
    assert (summary["first_step"], summary["last_step"]) == (8, 30)
    assert summary["mfu"] is not None and "MFU:" in log


def test_an_extended_run_says_its_learning_rate_changed(
    cosine_extended: tuple[Path, Path, str],
) -> None:
    """Point 9: past the warm-up, extending 20 -> 40 changes the learning rate in effect
    at the resumed step; the header says both values. (Inside the warm-up, and for a
    constant rate, it says nothing: test_extending_20_to_40_equals_a_straight_40.)"""
    log = cosine_extended[2]
    line = next(x for x in log.splitlines() if "learning rate at step 21" in x)
    # Cosine reaches 0 at the end of a 20-step run; a 40-step one is 15 of its 35 decay
    # steps down: 0.05 * (1 + cos(pi * 15/35)) / 2.
    assert "0 -> 0.0306" in line and "now spans 40 steps, not 20" in line, line


def test_refusals_that_a_run_directory_decides_come_before_any_process(
    data: Path, tmp_path: Path
) -> None:
    """Point 10: they came from a rank after the workers started ("error on rank 1")
    and could leave files behind. Now the parent says them, the disk untouched."""
    run = tmp_path / "run"
    two = ["--nproc", "2"]
    assert _train(run, data, *two, "--max-steps", "10", "--stop-after", "6")[0] == 0
    before = _snapshot(run)
    refused = {
        "changed settings": (["--max-steps", "10", "--seed", "4"], "would change what the run means"),
        "shorter": (["--max-steps", "5"], "past the 5 steps that --max-steps 5"),
        "profile past the end": (["--max-steps", "10", "--profile", "12-13"], "has 10 steps"),
        "fork from nothing": (["--max-steps", "10", "--out", str(tmp_path / "none"), "--fork",
                               str(tmp_path / "f")], "no checkpoint and no model.pt"),
    }  # fmt: skip
    for name, (extra, said) in refused.items():
        code, log = _train(run, data, *two, *extra)
        assert code == 2 and said in log, (name, log)
        assert "rank" not in log and "Traceback" not in log, (name, log)
        assert _snapshot(run) == before, name
    assert not (tmp_path / "f").exists()
    assert _train(run, data, *two, "--max-steps", "10")[0] == 0
    code, log = _train(run, data, *two, "--max-steps", "10")
    assert code == 2 and "already finished at step 10 of 10" in log and "rank" not in log, log


def test_a_finished_run_keeps_its_last_checkpoint_to_extend_or_fork(
    data: Path, tmp_path: Path, ten_steps: tuple[Path, str], ten_steps_bare: Path
) -> None:
    """Point 11: a run trained with the defaults could be neither extended nor forked."""
    run, log = _copy(ten_steps[0], tmp_path / "run"), ten_steps[1]
    assert (run / "checkpoints" / "step-000010" / "manifest.json").is_file()
    assert "kept the last checkpoint" in log and "--no-save-last" in log
    code, log = _train(run, data, "--max-steps", "15")
    assert code == 0 and "resumed at step 10, extending to 15" in log, log
    # Without it (--no-save-last), a fork takes the finished run's weights (model.pt).
    bare, fork = _copy(ten_steps_bare, tmp_path / "bare"), tmp_path / "fork"
    assert not (bare / "checkpoints").exists()
    code, log = _train(bare, data, "--max-steps", "5", "--fork", str(fork), "--fork-optimizer")
    assert code == 2 and "no optimizer state to take" in log, log
    assert not fork.exists()
    code, log = _train(bare, data, "--max-steps", "5", "--fork", str(fork))
    assert code == 0, log
    assert f"forked from {bare}/model.pt: its weights, from step 0" in log
    forked = json.loads((fork / "config.json").read_text())["run"]["forked_from"]
    assert forked == {"run": str(bare), "checkpoint": f"{bare}/model.pt", "step": None,
                      "optimizer": False}  # fmt: skip
