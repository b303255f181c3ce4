"""`scaletrain train`'s own LoopObservers: progress on the terminal and metrics.jsonl.

(The hang watchdog's, the step ledger's and the trackers' are observe's: see
scaletrain.observe.events.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from scaletrain.observe.events import EvalEvent, LoopObserver, RunInfo, say_off
from scaletrain.train.progress import StepProgress

__all__ = ["MetricsLog", "ProgressPrinter"]


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


class ProgressPrinter(LoopObserver):
    """Rank 0's terminal: the run header, a live bar per epoch (plain lines in a log
    file), each evaluation, and the last line."""

    reports = "the progress display"

    def __init__(self, progress: StepProgress | None = None) -> None:
        self.progress = progress or StepProgress(enabled=True)
        self._epochs = 1
        self._label = ""

    def print(self, message: Any) -> None:
        """A line (or a rich renderable: the ledger's table) above the live bar. The
        ledger prints through this between its collectives: a failure here is said
        once and the display goes off; it never reaches the ledger."""
        if not self.progress.enabled:
            return
        try:
            self.progress.print(message)
        except Exception as exc:
            self.progress.enabled = False
            say_off(self.reports, exc)

    def on_run_start(self, info: RunInfo) -> None:
        for line in info.header:
            self.progress.print(line)

    def on_epoch_start(self, epoch: int, epochs: int, steps_in_epoch: int, done: int) -> None:
        self._epochs = epochs
        self.progress.start_epoch(f"epoch {epoch + 1}/{epochs}", steps_in_epoch, done)

    def on_log(self, record: Mapping[str, Any]) -> None:
        self.progress.update(
            int(record["step_in_epoch"]),
            int(record["steps_in_epoch"]),
            float(record["loss"]),
            float(record["samples_per_s"]),
        )

    def on_epoch_end(self, epoch: int) -> None:
        self.progress.end_epoch()

    def on_eval(self, event: EvalEvent) -> None:
        self.progress.print(
            f"epoch {event.epoch + 1}/{self._epochs}: val_loss {event.loss:.4f}  "
            f"{event.metric} {event.accuracy:.4f}  ({event.count:,} {event.unit}, all ranks)"
        )

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        saved = f"saved {path}" if path is not None else "nothing to save yet"
        self.progress.print(
            f"stopped at step {step}/{total_steps} ({reason}); {saved}. "
            "Run the same command again to resume."
        )

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        what = "test accuracy" if summary.get("task") == "classification" else "next-token accuracy"
        result = (
            f"; {what} {summary['val_acc']:.4f}, loss {summary['val_loss']:.4f}"
            if summary.get("val_loss") is not None
            else "; evaluation skipped (--eval-batches 0)"
        )
        out = summary["out"]
        kept = ""
        if summary.get("checkpoint"):
            kept = (
                f"; kept the last checkpoint to extend or fork the run ({summary['checkpoint']}, "
                f"{_size(int(summary.get('checkpoint_bytes') or 0))}; --no-save-last skips it)"
            )
        # A resumed start trained from where it resumed: its count, time and pace are
        # that part's (summary.json keeps the whole run's too).
        end, start = int(summary["steps"]), int(summary.get("started_at") or 0)
        seconds = float(summary.get("start_time_s", summary["train_time_s"]))
        rate = float(summary.get("start_samples_per_s", summary["samples_per_s"]))
        compiled = summary.get("start_compile_time_s", summary.get("compile_time_s"))
        pace = (
            f" in {seconds:.1f} s" + (f" ({compiled:.1f} s of it compiling)" if compiled else "")
            + f", {rate:,.0f} samples/s over "
            + _plural(int(summary["world_size"]), "process", "processes")
        )  # fmt: skip
        trained = (
            f"no step left to train (resumed at step {start}, the run's last)" if start >= end
            else f"{_plural(end - start, 'step')} (steps {start + 1}-{end}, resumed at {start}){pace}"
            if start else f"{_plural(end, 'step')}{pace}"
        )  # fmt: skip
        self.progress.print(
            f"done: {trained}{result}. Wrote {out}/metrics.jsonl and {out}/model.pt{kept}"
        )

    def close(self) -> None:
        self.progress.end_epoch()


def _size(n: int) -> str:
    """Bytes as a person reads them on a disk (decimal units, as `df -H` and vendors)."""
    if n < 1000:
        return f"{n:,} bytes"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:,.1f} {unit}"


class MetricsLog(LoopObserver):
    """RUN/metrics.jsonl: one JSON object per line (`train`, `eval`, `summary`), each
    with `time`, the Unix time it was written."""

    reports = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def write(self, **record: Any) -> None:
        if self._file is not None:
            record["time"] = round(time.time(), 3)
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def on_log(self, record: Mapping[str, Any]) -> None:
        self.write(
            event="train",
            step=record["step"],
            epoch=record["epoch"] + 1,
            loss=record["loss"],
            window_steps=record["window_steps"],
            lr=record["lr"],
            samples_per_s=record["samples_per_s"],
        )

    def on_eval(self, event: EvalEvent) -> None:
        self.write(
            event="eval",
            step=event.step,
            epoch=event.epoch + 1,
            val_loss=event.loss,
            val_acc=event.accuracy,
            count=event.count,
        )

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self.write(**summary)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
