"""Experiment trackers (issue 27): the protocol the loop calls, TensorBoard and MLflow on
it, --track, and a failing tracker said once while training goes on."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import scaletrain as st
from scaletrain.observe.events import EvalEvent, EventBus, RunInfo
from scaletrain.observe.metrics.phases import PHASES
from scaletrain.observe.metrics.window import RankWindow, WindowStats
from scaletrain.observe.report.trackers import (
    TrackerObserver,
    TrackerStatus,
    make_trackers,
    track_names,
)


class FakeTracker:
    """A tracker of the user's own: records every call; raises at a chosen call."""

    name = "fake"

    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_at = fail_at

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] == self.fail_at:
            raise OSError(28, "No space left on device")

    def start(self, run_dir: Path, params: Mapping[str, Any]) -> None:
        self._call("start", run_dir, dict(params))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._call("log", dict(scalars), step)

    def close(self, status: TrackerStatus = "finished") -> None:
        self._call("close", status)


class FakeLedger:
    def __init__(self) -> None:
        self.listeners: list[Any] = []

    def window(self, last_step: int) -> None:
        phases = [0.001 * (i + 1) for i in range(len(PHASES))]
        stats = WindowStats.build(
            last_step - 4,
            last_step,
            [RankWindow(rank=0, peer_group=0, steps=5, wall=0.05, phases=phases)],
        )
        for listener in self.listeners:
            listener(stats, [])


def _info(tmp_path: Path) -> RunInfo:
    return RunInfo(
        out=tmp_path, rank=0, world_size=1, start_step=0, total_steps=10, steps_per_epoch=10,
        epochs=1, global_batch=4, config={"lr": 0.1, "run": {"world_size": 1}},
    )  # fmt: skip


def _record(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 2.5, "lr": 0.1, "samples_per_s": 100.0}


def test_the_loop_feeds_a_tracker_of_the_users_own(tmp_path: Path) -> None:
    """Anything with name, start, log and close is a tracker: it gets the run directory
    and settings at the start, named scalars at their steps, and how the run ended."""
    tracker, ledger = FakeTracker(), FakeLedger()
    assert isinstance(tracker, st.Tracker)
    observers = EventBus([TrackerObserver(tracker, ledger)])  # type: ignore[arg-type]
    observers.on_run_start(_info(tmp_path))
    observers.on_log(_record(5))
    ledger.window(5)
    observers.on_eval(EvalEvent(step=5, epoch=0, loss=1.5, accuracy=0.25, count=10,
                                unit="tokens", metric="next-token acc"))  # fmt: skip
    observers.on_run_end({})
    observers.close()
    assert tracker.calls[0] == ("start", tmp_path, {"lr": 0.1, "run": {"world_size": 1}})
    assert tracker.calls[1] == (
        "log", {"train/loss": 2.5, "train/lr": 0.1, "train/samples_per_s": 100.0}, 5
    )  # fmt: skip
    _, window, step = tracker.calls[2]
    assert step == 5 and window["ledger/forward_ms_median"] == pytest.approx(
        PHASES.index("forward") + 1.0
    )
    assert window["ledger/step_ms_max"] == pytest.approx(50.0)
    assert tracker.calls[3] == ("log", {"eval/loss": 1.5, "eval/next-token_acc": 0.25}, 5)
    assert tracker.calls[4:] == [("close", "finished")]


@pytest.mark.parametrize(("ending", "status"), [("stop", "stopped"), (None, "failed")])
def test_a_tracker_is_told_how_the_run_ended(
    tmp_path: Path, ending: str | None, status: str
) -> None:
    tracker = FakeTracker()
    observer = TrackerObserver(tracker)
    observer.on_run_start(_info(tmp_path))
    if ending == "stop":
        observer.on_stop(3, 10, "--stop-after 3", tmp_path / "checkpoints")
    observer.close()
    observer.close()  # once only
    assert [c for c in tracker.calls if c[0] == "close"] == [("close", status)]


@pytest.mark.parametrize("fail_at", ["start", "log"])
def test_a_failing_tracker_is_said_once_and_dropped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], fail_at: str
) -> None:
    tracker, ledger = FakeTracker(fail_at), FakeLedger()
    observers = EventBus([TrackerObserver(tracker, ledger)])  # type: ignore[arg-type]
    observers.on_run_start(_info(tmp_path))
    for step in (5, 10):
        observers.on_log(_record(step))
        ledger.window(step)  # after the drop, windows reach the tracker no more
    observers.on_run_end({})
    observers.close()
    err = capfd.readouterr().err
    assert err == (
        "scaletrain: the fake tracker failed (OSError: [Errno 28] No space left on device) "
        "and is off for the rest of the run; training goes on.\n"
    )
    assert observers.members == []
    assert [c[0] for c in tracker.calls] == [*(["start"] if fail_at == "start" else []),
                                             *(["start", "log"] if fail_at == "log" else []),
                                             "close"]  # fmt: skip
    assert tracker.calls[-1] == ("close", "failed")


def test_a_tracker_failing_in_a_ledger_window_never_reaches_the_ledger(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The ledger calls its listeners between its collectives, outside the observers'
    guard: the failure is said once there, and the tracker is off for the loop too."""
    tracker, ledger = FakeTracker(), FakeLedger()
    observers = EventBus([TrackerObserver(tracker, ledger)])  # type: ignore[arg-type]
    observers.on_run_start(_info(tmp_path))
    tracker.fail_at = "log"
    ledger.window(5)  # raises inside the tracker; not here
    observers.on_log(_record(10))
    ledger.window(10)
    observers.on_run_end({})
    observers.close()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the fake tracker failed (OSError" in err
    assert [c[0] for c in tracker.calls] == ["start", "log", "close"]


def test_tensorboard_writes_scalars_and_the_settings(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = st.TensorBoardTracker()
    tracker.start(tmp_path, {"lr": 0.1, "run": {"world_size": 1}})
    tracker.log({"train/loss": 2.0}, 3)
    tracker.log({"train/loss": 1.0}, 6)
    tracker.close()
    tracker.log({"train/loss": 0.5}, 9)  # after close: nothing
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 2.0), (6, 1.0)]
    assert "config/text_summary" in acc.Tags()["tensors"]


def _mlflow_run(store: Path) -> tuple[Path, str]:
    """The one MLflow run in a file store (experiment folders hold meta.yaml and runs)."""
    runs = [p for p in store.glob("*/*") if (p / "meta.yaml").is_file() and p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0], runs[0].name


def _series(run: Path, key: str) -> list[tuple[int, float]]:
    """A metric's file in MLflow's file store: `timestamp value step` per line."""
    lines = (run / "metrics" / key).read_text().split("\n")
    return [(int(s), float(v)) for _, v, s in (line.split() for line in lines if line)]


def test_mlflow_writes_a_file_store_in_the_run_directory_and_resumes_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    first = st.MLflowTracker()
    first.start(run_dir, {"max_steps": 6, "run": {"world_size": 2}, "mesh": None})
    first.log({"train/loss": 2.0, "train/lr": 0.1}, 3)
    first.log({"train/loss": 1.5, "train/lr": 0.1}, 6)
    first.close("stopped")
    run, run_id = _mlflow_run(run_dir / "mlruns")
    assert json.loads((run_dir / "mlflow.json").read_text()) == {"runs": {"mlruns": run_id}}
    params = {p.name: p.read_text() for p in (run / "params").iterdir()}
    assert params == {"max_steps": "6", "run.world_size": "2", "mesh": "None"}
    assert (run / "tags/mlflow.runName").read_text() == "my-run"

    # Resumed (a new process: a new tracker object) with a longer run: the same MLflow
    # run goes on; the parameter keeps its first value, the new one is a tag.
    again = st.MLflowTracker()
    again.start(run_dir, {"max_steps": 12, "run": {"world_size": 2}, "mesh": None})
    again.log({"train/loss": 1.0}, 9)
    again.close()
    assert _mlflow_run(run_dir / "mlruns") == (run, run_id)
    assert _series(run, "train/loss") == [(3, 2.0), (6, 1.5), (9, 1.0)]
    assert (run / "params/max_steps").read_text() == "6"
    assert (run / "tags/resumed.max_steps").read_text() == "12"
    back = st.MLflowTracker()  # a third start, with the first value again: said too
    back.start(run_dir, {"max_steps": 6})
    back.close()
    assert (run / "tags/resumed.max_steps").read_text() == "6"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.metrics["train/loss"] == 1.0
    assert client.get_experiment(got.info.experiment_id).name == "scaletrain"


def test_mlflow_writes_to_the_tracking_uri_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "shared-store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # a directory: a file store
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep")
    tracker = st.MLflowTracker()
    tracker.start(tmp_path / "run", {})
    tracker.close()
    assert not (tmp_path / "run" / "mlruns").exists()
    _, run_id = _mlflow_run(store)
    ids = json.loads((tmp_path / "run" / "mlflow.json").read_text())
    assert ids == {"runs": {store.as_uri(): run_id}}


def test_trackers_write_on_rank_zero_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop of the user's own may call them on every rank: only rank 0 writes."""
    monkeypatch.setenv("RANK", "1")
    for tracker in (st.TensorBoardTracker(), st.MLflowTracker()):
        tracker.start(tmp_path, {"lr": 0.1})
        tracker.log({"train/loss": 1.0}, 1)
        tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_track_names_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert track_names("MLflow, tensorboard,mlflow") == ("mlflow", "tensorboard")
    assert track_names("none") == () and make_trackers("none") == []
    assert track_names(None) == ("tensorboard",)  # installed here (a test dependency)
    monkeypatch.setattr("scaletrain.observe.report.trackers._installed", lambda module: False)
    assert track_names(None) == ()  # not installed: no tracker, as before
    assert [type(t).__name__ for t in make_trackers("tensorboard,mlflow")] == [
        "TensorBoardTracker",
        "MLflowTracker",
    ]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("wandb", "--track wandb: 'wandb' is not a tracker scaletrain writes to; expected a "
                  "comma-separated list of tensorboard, mlflow, or none. Fix: name only these, "
                  "e.g. --track tensorboard,mlflow."),
        ("tensorbord,mlflow", "Fix: --track tensorboard,mlflow."),
        ("none,mlflow", "none means no tracker, but other trackers are named with it. Fix: "
                        "--track none alone, or drop none."),
        (",", "--track ,: expected a comma-separated list"),
    ],
)  # fmt: skip
def test_track_mistakes_are_refused_before_anything_starts(value: str, words: str) -> None:
    from scaletrain.errors import use_cli_names
    from scaletrain.train import TrainConfig

    use_cli_names()
    with pytest.raises(st.ConfigError) as info:
        TrainConfig(track=value)
    assert words in str(info.value)


def test_a_tracker_not_installed_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from scaletrain.errors import use_cli_names
    from scaletrain.train import TrainConfig

    use_cli_names()
    monkeypatch.setattr("scaletrain.observe.report.trackers._installed", lambda module: False)
    with pytest.raises(st.ConfigError) as info:
        TrainConfig(track="mlflow")
    assert str(info.value) == (
        "--track mlflow: mlflow needs the mlflow package, which is not installed. Fix: pip "
        "install 'scaletrain[mlflow]', or leave mlflow out of the list."
    )


def test_the_closing_line_speaks_of_this_start() -> None:
    """A resumed start's closing line gave its own step count beside the whole run's
    time and pace ("done: 2 steps (steps 4-5, resumed at 3) in 0.3 s, 598 samples/s":
    0.3 s and 598 were the 5 steps'), a start with nothing left to train "done: 0
    steps (steps 21-20, resumed at 20)", and one step "1 steps"."""
    import io

    from rich.console import Console

    from scaletrain.train.observers import ProgressPrinter
    from scaletrain.train.progress import StepProgress

    def said(**summary: Any) -> str:
        out = io.StringIO()
        printer = ProgressPrinter(StepProgress(enabled=True, console=Console(file=out, width=400)))
        base = {"task": "classification", "val_loss": None, "out": "run", "world_size": 2,
                "train_time_s": 0.27, "samples_per_s": 598.0}  # fmt: skip
        printer.on_run_end({**base, **summary})
        return " ".join(out.getvalue().split())

    resumed = said(steps=5, started_at=3, start_time_s=0.08, start_samples_per_s=800.0)
    assert resumed.startswith(
        "done: 2 steps (steps 4-5, resumed at 3) in 0.1 s, 800 samples/s over 2 processes;"
    ), resumed
    nothing = said(steps=20, started_at=20, start_time_s=0.0, start_samples_per_s=0.0)
    assert nothing.startswith("done: no step left to train (resumed at step 20, the run's "
                              "last); evaluation skipped"), nothing  # fmt: skip
    one = said(steps=1, started_at=0, start_time_s=0.27, start_samples_per_s=598.0)
    assert one.startswith("done: 1 step in 0.3 s, 598 samples/s over 2 processes;"), one
