"""What a profile window says on the console: one line with where its traces are and the
overlap they measured, and none of kineto's own progress lines (issue 26)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from scaletrain.observe.metrics.profiling import ProfileWindow


class _Ledger(SimpleNamespace):
    """What a one-rank ProfileWindow uses of the StepLedger."""

    def __init__(self) -> None:
        super().__init__(_gather=None, device_type="cpu", records=[], said=[])

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def say(self, message: Any) -> None:
        self.said.append(str(message))


def test_a_window_says_where_its_traces_went_and_kineto_stays_quiet(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ledger = _Ledger()
    window = ProfileWindow(3, 4, tmp_path / "traces", rank=0, world_size=1)
    window._start(ledger)
    # A line of anyone else's on stderr while the profiler starts is passed on.
    os.write(2, b"a line of ours\n")
    for _ in range(2):
        torch.ones(64, 64) @ torch.ones(64, 64)
        window._prof.step()
    window._stop(ledger, collective=False)
    merged = window.merge(ledger)
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err and "profiler_stop" not in err
    assert "a line of ours" in err
    assert merged is not None and merged.is_file()
    assert ledger.said == [
        f"profile: steps 3-4 of 1 rank traced to {tmp_path / 'traces'} (merged.json.gz: every "
        "rank on one timeline, for Perfetto or TensorBoard); no communication in the window, "
        "so no overlap to measure"
    ]


def test_the_overlap_line_names_the_median_and_the_lowest_rank(tmp_path: Path) -> None:
    window = ProfileWindow(10, 15, tmp_path, rank=0, world_size=3)
    window.results = {
        "ranks": [
            {"rank": 0, "overlap": 0.5},
            {"rank": 1, "overlap": 0.25},
            {"rank": 2, "overlap": 0.75},
        ]
    }
    line = window.summary_line(tmp_path / "merged.json.gz")
    assert line.startswith(f"profile: steps 10-15 of 3 ranks traced to {tmp_path} (merged")
    assert line.endswith(
        "communication overlapped with compute in the traces: median 50%, lowest 25% (rank 1)"
    )
    assert "\n" not in line
