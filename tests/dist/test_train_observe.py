"""`scaletrain train` with the ledger and a profile window, then `scaletrain report`, opened in
a real headless Chromium. One training run (module fixture) serves every check; the report
commands and the refusal run in this process (tests/inprocess.py)."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.testing import launcher_free_env, write_fake_mnist
from tests.browser import find_chromium, open_page
from tests.inprocess import run_cli

pytestmark = pytest.mark.timeout(300)


def _scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        cwd=cwd,
        env=launcher_free_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("observe")
    data = write_fake_mnist(tmp / "data", n_train=480, n_test=60, seed=3)
    run = tmp / "run"
    done = _scaletrain(
        "train", "--nproc", "2", "--max-steps", "12", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(run), "--log-every", "3",
        "--ledger-every", "5", "--profile", "3-4",
        cwd=tmp,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return run, done


def test_train_prints_the_phase_table_and_writes_the_ledger(
    trained: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run, done = trained
    out = done.stdout
    assert "where the time goes" in out
    for phase in ("data", "forward", "backward", "comm", "step"):
        assert f"│ {phase}" in out
    assert "MFU:" in out and "peak memory" in out
    from scaletrain.observe.metrics.records import read_run

    records = read_run(run)
    assert sorted(records.ranks) == [0, 1]
    for rr in records.ranks.values():
        steps = rr.steps
        assert [s.step for s in steps] == list(range(1, 13))
        for prev, s in itertools.pairwise(steps):
            # Phases tile the step; the step is the time between two optimizer steps
            # (the records' own end times, another clock).
            assert sum(s.phases.values()) == pytest.approx(s.wall, rel=1e-3, abs=1e-5)
            assert abs((s.t - prev.t) - s.wall) <= 0.05 * s.wall + 2e-3
        # The loop's stop agreement (rt.any_rank every step) is visible as sync.
        assert all(s.phases["sync"] > 0 for s in steps[1:] if s.counted)
        # Evaluation ran after the last step only; checkpoints never (no --save-every).
        assert all(s.phases["checkpoint"] == 0 for s in steps)
    summary = records.summary
    assert summary is not None and summary["last_step"] == 12
    assert (run / "traces" / "merged.json.gz").is_file()
    overlap = json.loads((run / "traces" / "overlap.json").read_text())
    assert overlap["first_step"] == 3 and len(overlap["ranks"]) == 2
    traces = sorted((run / "traces").glob("rank*.pt.trace.json.gz"))
    assert len(traces) == 2  # one per rank, names differ by rank (and host, pid, time)
    with gzip.open(traces[0], "rt") as f:
        assert any("ProfilerStep#" in e.get("name", "") for e in json.load(f)["traceEvents"])


def test_the_profile_is_told_in_one_line_without_kinetos_lines(
    trained: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """issue 26: the traces' place and overlap went unsaid, and kineto's `USDT ...
    profiler_start` lines (one per rank and call) reached the console."""
    run, done = trained
    console = done.stdout + done.stderr
    assert "USDT" not in console and "profiler_st" not in console, console
    lines = [line for line in console.splitlines() if line.startswith("profile:")]
    assert len(lines) == 1, console
    assert f"profile: steps 3-4 of 2 ranks traced to {run / 'traces'} (merged.json.gz" in lines[0]
    assert "communication overlapped with compute in the traces: median " in lines[0]


def test_tensorboard_scalars_are_written(
    trained: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run, _ = trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s"} <= tags
    assert {"ledger/forward_ms_median", "ledger/step_ms_max"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [3, 6, 9, 12]


def test_report_opens_offline_in_chromium_with_every_plot_drawn(
    trained: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run, _ = trained
    done = run_cli("report", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    page = run / "report.html"
    text = page.read_text()
    assert "<script src=" not in text.replace('<script src="data:', "")  # nothing fetched
    assert find_chromium(), "Debian's chromium is missing: run `make setup`"
    check = """(() => [...document.querySelectorAll('.plotly-graph-div')].map(d => ({
        svg: !!d.querySelector('.main-svg'), traces: (d._fullData || []).length,
        marks: d.querySelectorAll('.point, .scatterlayer .trace path').length })))()"""
    shot = tmp_path / "report.png"
    result = open_page(page.as_uri(), check=check, screenshot=shot)
    assert result.errors == []
    assert result.requests and all(u.startswith(("file:", "data:")) for u in result.requests)
    plots = result.value
    assert len(plots) == 7  # breakdown, step time, overlap, throughput, loss+lr, MFU, memory
    for plot in plots:
        assert plot["svg"] and plot["traces"] > 0 and plot["marks"] > 0, plots
    assert shot.stat().st_size > 50_000  # a real picture, not a blank page


def test_report_errors_in_the_words_of_the_command(tmp_path: Path) -> None:
    done = run_cli("report", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert done.returncode == 2 and "is not a directory" in done.stderr
    (tmp_path / "empty").mkdir()
    done = run_cli("report", str(tmp_path / "empty"), cwd=tmp_path)
    assert done.returncode == 2
    assert "holds no ledger files" in done.stderr
    assert done.stderr.count("scaletrain: error") == 1 and len(done.stderr.splitlines()) == 1


def test_a_profile_window_past_the_end_fails_before_training(tmp_path: Path) -> None:
    data = write_fake_mnist(tmp_path / "data", n_train=80, n_test=20, seed=3)
    done = run_cli(
        "train", "--nproc", "1", "--max-steps", "4", "--batch-size", "20",
        "--data-dir", str(data), "--out", str(tmp_path / "r"), "--profile", "10-12",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--profile 10-12: this run has 4 steps" in done.stderr
    assert "Traceback" not in done.stderr
