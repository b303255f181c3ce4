"""`scaletrain train --track`: MLflow's file store read back after real runs, a resumed run
continuing the same MLflow run, and a tracker that fails said once while the run
finishes (issue 27)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scaletrain.testing import launcher_free_env, write_fake_mnist
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _scaletrain(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = launcher_free_env()
    for name in list(environ):
        if name.startswith("MLFLOW_"):
            del environ[name]
    # Nothing leaves the machine in a test (MLflow's usage telemetry included).
    environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    environ.update(env or {})
    # In this process (tests/inprocess.py): MLflow's import alone costs seconds a process.
    return run_cli(*args, cwd=cwd, env=environ)


def _train(
    tmp: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    data = tmp / "data"
    if not data.exists():
        write_fake_mnist(data, n_train=480, n_test=60, seed=3)
    return _scaletrain(
        "train", "--nproc", "1", "--max-steps", "12", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(tmp / "run"), "--log-every", "3",
        "--ledger-every", "5", *extra,
        cwd=tmp, env=env,
    )  # fmt: skip


def test_mlflow_file_store_holds_the_run_and_a_resume_continues_it(tmp_path: Path) -> None:
    stopped = _train(tmp_path, "--track", "mlflow", "--stop-after", "6")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    done = _train(tmp_path, "--track", "mlflow")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout
    run = tmp_path / "run"
    assert not (run / "tensorboard").exists()  # --track names mlflow alone

    # One MLflow run in RUN/mlruns, the one RUN/mlflow.json names: the resume went on
    # logging to it rather than starting a second.
    runs = [p for p in (run / "mlruns").glob("*/*") if (p / "meta.yaml").is_file()]
    assert len(runs) == 1, runs
    mlrun = runs[0]
    assert json.loads((run / "mlflow.json").read_text()) == {"runs": {"mlruns": mlrun.name}}

    # Parameters: the resolved settings and the run's facts, one file each.
    params = {p.name: p.read_text() for p in (mlrun / "params").iterdir()}
    assert params["batch_size"] == "20" and params["max_steps"] == "12"
    assert params["recipe"] == "convnet" and params["track"] == "mlflow"
    assert params["run.world_size"] == "1"
    assert params["stop_after"] == "6"  # the first start's; the resume's is a tag
    assert (mlrun / "tags/resumed.stop_after").read_text() == "None"
    assert (mlrun / "tags/mlflow.runName").read_text() == "run"

    # Metrics: `timestamp value step` lines, the same steps and losses as metrics.jsonl.
    def series(key: str) -> list[tuple[int, float]]:
        lines = (mlrun / "metrics" / key).read_text().splitlines()
        return [(int(s), float(v)) for _, v, s in (line.split() for line in lines)]

    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if r["event"] == "train"]
    assert [s for s, _ in train] == [3, 6, 9, 12]
    assert series("train/loss") == train
    assert [s for s, _ in series("train/lr")] == [3, 6, 9, 12]
    evals = [r for r in records if r["event"] == "eval"]
    assert series("eval/val_acc") == [(12, evals[0]["val_acc"])]
    # The ledger's windows at their last steps (a resumed run's count from its start).
    windows = [s for s, _ in series("ledger/step_ms_median")]
    assert windows[0] == 5 and windows == sorted(windows) and windows[-1] <= 12

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # restored after the test (conftest)
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    info = client.get_run(mlrun.name).info
    assert info.status == "FINISHED" and info.run_name == "run"


def test_a_failing_tracker_is_said_once_and_the_run_finishes(tmp_path: Path) -> None:
    """MLflow's store cannot be made (its path is under a file): one line says the
    MLflow tracker is off, TensorBoard and the run go on to model.pt."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file")
    env = {"MLFLOW_TRACKING_URI": (blocker / "mlruns").as_uri()}
    done = _train(tmp_path, "--track", "tensorboard,mlflow", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    console = done.stdout + done.stderr
    lines = [line for line in console.splitlines() if "tracker failed" in line]
    assert len(lines) == 1, console
    assert lines[0].startswith("scaletrain: the MLflow tracker failed (NotADirectoryError")
    assert lines[0].endswith("and is off for the rest of the run; training goes on.")
    run = tmp_path / "run"
    assert (run / "model.pt").is_file()
    assert not (run / "mlflow.json").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [3, 6, 9, 12]


def _own_loop(run_dir: str) -> int:
    """The docs' loop of your own: every rank calls the trackers; rank 0 writes."""
    import torch

    import scaletrain as st

    rt = st.init(strategy="ddp", ledger=False)
    model = torch.nn.Linear(4, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    trackers = [st.MLflowTracker(), st.TensorBoardTracker()]
    for tracker in trackers:
        tracker.start(run_dir, {"lr": 0.1, "world_size": rt.world_size})
    for step in range(1, 5):
        loss = model(torch.randn(8, 4, device=rt.device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = rt.reduce({"loss": loss.detach()}, op="mean")["loss"]
        for tracker in trackers:
            tracker.log({"train/loss": float(mean)}, step)
    for tracker in trackers:
        tracker.close()
    rank = rt.rank
    rt.shutdown()
    return rank


def test_trackers_in_a_loop_of_your_own_write_once_from_rank_zero(tmp_path: Path) -> None:
    from scaletrain.testing import run_ranks

    run = tmp_path / "mine"
    env = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": ""}
    assert run_ranks(_own_loop, 2, str(run), timeout=150, env=env) == [0, 1]
    runs = [p for p in (run / "mlruns").glob("*/*") if (p / "meta.yaml").is_file()]
    assert len(runs) == 1, runs
    assert (runs[0] / "params/world_size").read_text() == "2"
    lines = (runs[0] / "metrics/train/loss").read_text().splitlines()
    assert [int(line.split()[2]) for line in lines] == [1, 2, 3, 4]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
