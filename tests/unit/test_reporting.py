"""Nothing that only reports may stop training: a closed output or a failing reporter is
said once, and the run goes on (issue 26)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from scaletrain.observe.events import EventBus, LoopObserver
from scaletrain.observe.output import LossyStream


def test_a_closed_pipe_is_said_once_and_later_writes_are_dropped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone, as `| head` is after its lines
    stream = LossyStream(os.fdopen(write, "w", buffering=1), then="Training goes on.")
    assert stream.write("line 1\n") == 7
    stream.flush()
    stream.write("line 2\n")
    stream.flush()
    assert stream.lost is not None and "BrokenPipeError" in stream.lost
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "standard output was closed" in err
    assert err.endswith("the rest of this output is lost. Training goes on.\n")
    # What was buffered for the pipe now goes to /dev/null: closing it succeeds.
    stream.close()


def test_the_progress_printer_never_raises_into_the_ledger(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from scaletrain.train.observers import ProgressPrinter
    from scaletrain.train.progress import StepProgress

    class Broken:
        def print(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("cannot render")

        is_terminal = False

    printer = ProgressPrinter(StepProgress(enabled=True, console=Broken()))  # type: ignore[arg-type]
    printer.print("a straggler warning")  # as the ledger calls it, between collectives
    printer.print("the table")
    err = capfd.readouterr().err
    assert err.count("the progress display failed (RuntimeError: cannot render)") == 1


class _Reporter(LoopObserver):
    reports = "the test display"

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.closed = False

    def on_log(self, record: Mapping[str, Any]) -> None:
        self.seen.append(int(record["step"]))
        if record["step"] == 2:
            raise BrokenPipeError(32, "Broken pipe")

    def close(self) -> None:
        self.closed = True


class _Participant(LoopObserver):
    def on_log(self, record: Mapping[str, Any]) -> None:
        if record["step"] == 3:
            raise RuntimeError("a collective failed")


def test_a_failing_reporter_is_dropped_with_one_line_and_others_go_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    reporter, participant = _Reporter(), _Participant()
    observers = EventBus([reporter, participant])
    observers.on_log({"step": 1})
    observers.on_log({"step": 2})  # the reporter fails: said, dropped, no error
    err = capfd.readouterr().err
    assert err == (
        "scaletrain: the test display failed (BrokenPipeError: [Errno 32] Broken pipe) and is "
        "off for the rest of the run; training goes on.\n"
    )
    assert reporter.closed and observers.members == [participant]
    with pytest.raises(RuntimeError, match="a collective failed"):
        observers.on_log({"step": 3})  # one that takes part in the run: its error is the run's
    assert reporter.seen == [1, 2]


def test_the_trainers_reporters_say_what_they_report(tmp_path: Path) -> None:
    from scaletrain.observe.hang.watchdog import WatchdogObserver
    from scaletrain.observe.metrics.ledger_observer import LedgerObserver
    from scaletrain.observe.report.trackers import (
        MLflowTracker,
        TensorBoardTracker,
        TrackerObserver,
    )
    from scaletrain.train.observers import MetricsLog, ProgressPrinter

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.close()
    assert ProgressPrinter.reports and log.reports
    assert TrackerObserver(TensorBoardTracker()).reports == "the TensorBoard tracker"
    assert TrackerObserver(MLflowTracker()).reports == "the MLflow tracker"
    # The watchdog and the ledger take part in the run: their errors stop it.
    assert not WatchdogObserver.reports and not LedgerObserver.reports


def test_tensorboard_opens_its_writer_when_the_run_starts_never_inside_a_step(
    tmp_path: Path,
) -> None:
    """Opened at the ledger's first window (inside step 10), importing TensorBoard and
    creating its writer read as a quarter of a second of that step's synchronisation: a
    one-process GPU run's table said 62-68% sync and advised reducing less often."""
    from scaletrain.observe.events import RunInfo
    from scaletrain.observe.report.trackers import TensorBoardTracker, TrackerObserver

    logdir = tmp_path / "tensorboard"
    tracker = TensorBoardTracker()
    scalars = TrackerObserver(tracker)
    assert not logdir.exists()  # a start refused before on_run_start leaves nothing
    scalars.on_run_start(
        RunInfo(out=tmp_path, rank=0, world_size=1, start_step=0, total_steps=10,
                steps_per_epoch=10, epochs=1, global_batch=4)
    )  # fmt: skip
    assert tracker._writer is not None and any(logdir.iterdir())
    scalars.close()
