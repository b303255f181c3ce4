"""What a run directory holds, and what --overwrite and a fresh start do with it."""

from __future__ import annotations

from pathlib import Path

from scaletrain.train.rundir import clear_run, inspect_run, set_aside_interrupted


def _run_with_everything(path: Path) -> None:
    """The files a finished run with the ledger, TensorBoard, a profile and a report has."""
    for folder in ("checkpoints/step-000010", "observe", "tensorboard", "mlruns", "traces", "hang"):
        (path / folder).mkdir(parents=True)
    (path / "mlruns/meta.yaml").write_text("x")
    (path / "checkpoints/step-000010/manifest.json").write_text("{}")
    (path / "observe/rank0.jsonl").write_text("{}\n")
    (path / "tensorboard/events.out").write_text("x")
    (path / "traces/rank0.json").write_text("{}")
    (path / "hang/rank0.txt").write_text("stack")
    for name in ("model.pt", "metrics.jsonl", "config.json", "report.html", "mlflow.json"):
        (path / name).write_text("x")


def test_overwrite_removes_everything_the_run_wrote_and_nothing_else(tmp_path: Path) -> None:
    """Issue 26, point 5: observe/, tensorboard/, traces/ and report.html stayed, so the
    report and `plan --check` drew the old run and the new one as one."""
    _run_with_everything(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own")
    removed = clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert {"observe", "tensorboard", "traces", "report.html", "hang"} <= set(removed)
    # Issue 27: an overwritten run's MLflow store and run id go too (else the new run
    # would log to the old MLflow run).
    assert {"mlruns", "mlflow.json"} <= set(removed)


def test_a_start_over_sets_aside_what_the_interrupted_run_wrote(tmp_path: Path) -> None:
    """A run interrupted before its first checkpoint: its ledger goes aside with its
    metrics, so the new run's ledger does not append to the old one's."""
    (tmp_path / "observe").mkdir()
    (tmp_path / "observe/rank0.jsonl").write_text("old\n")
    (tmp_path / "metrics.jsonl").write_text('{"event": "train", "step": 3}\n')
    (tmp_path / "report.html").write_text("old")
    (tmp_path / "mlflow.json").write_text('{"runs": {"mlruns": "abc"}}')
    said = set_aside_interrupted(inspect_run(tmp_path))
    assert said is not None and "observe.interrupted-1" in said
    # The MLflow run id goes aside too: the new run is a new MLflow run.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.interrupted-1.jsonl",
        "mlflow.interrupted-1.json",
        "observe.interrupted-1",
        "report.interrupted-1.html",
    ]
    assert (tmp_path / "observe.interrupted-1/rank0.jsonl").read_text() == "old\n"
    # --overwrite later removes those too.
    clear_run(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_resume_at_another_size_says_why_its_end_moved() -> None:
    """A run of 2 ranks resumed on 1 with --max-steps 6 (it was 2) said "the run now ends
    at step 6 (it was 2: the global batch changed with the data-parallel size)": the
    new --max-steps moved it. The global batch is the reason only where nobody asked."""
    from scaletrain.checkpoint.manager import Resumed
    from scaletrain.train.resume import resume_lines

    path = Path("run/checkpoints/step-000002")
    values = {"step": 2, "total_steps": 2,
              "config": {"max_steps": 2, "epochs": 1, "run": {"data_parallel_size": 2}}}  # fmt: skip
    asked = resume_lines(Resumed(path, values), values, 6, fork=None, dp_size=1,
                         length={"max_steps": 6, "epochs": 1})  # fmt: skip
    assert asked[0] == f"  resumed at step 2, extending to 6 (it was 2) from {path}", asked
    assert "data-parallel size 2 -> 1" in asked[1]
    epochs = {"step": 2, "total_steps": 20,
              "config": {"max_steps": None, "epochs": 1, "run": {"data_parallel_size": 2}}}  # fmt: skip
    regrouped = resume_lines(Resumed(path, epochs), epochs, 40, fork=None, dp_size=1,
                             length={"max_steps": None, "epochs": 1})  # fmt: skip
    assert "(it was 20: the global batch changed with the data-parallel size)" in regrouped[0]
