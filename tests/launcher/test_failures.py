"""A failed job is told once: the cause, from the workers' own error files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.errors import ConfigError, PeerFailure
from scaletrain.launch.failures import is_consequence, record_failure, summarize_failure

errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")


def _failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rank: int,
    exc: BaseException,
    *,
    exitcode: int,
    at: float,
) -> object:
    path = tmp_path / f"error-{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr("time.time", lambda: at)
    usage = isinstance(exc, (ConfigError, PeerFailure))
    assert record_failure(exc, rank=rank, usage=usage, exit_code=2 if usage else 1)
    monkeypatch.undo()
    return errors.ProcessFailure(
        local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path)
    )


def test_the_cause_is_shown_not_the_peers_that_failed_because_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 reports "a peer failed" a moment BEFORE rank 0's own error reaches its file:
    # the cause still wins, with the exit code it chose (the agent's SIGTERM came later).
    cause = _failure(tmp_path, monkeypatch, 0, ConfigError("--lr 0: bad"), exitcode=-15, at=20.0)
    echo = _failure(tmp_path, monkeypatch, 1, PeerFailure("rank 0 failed"), exitcode=2, at=10.0)
    exc = errors.ChildFailedError("scaletrain", {0: cause, 1: echo})
    summary, code = summarize_failure(exc)
    assert summary == "scaletrain: error on rank 0: --lr 0: bad"
    assert code == 2


def test_an_unexpected_error_shows_its_traceback_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        raise ValueError("boom")
    except ValueError as e:
        boom = _failure(tmp_path, monkeypatch, 1, e, exitcode=1, at=5.0)
    gone = RuntimeError("[../gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]")
    assert is_consequence(gone)
    other = _failure(tmp_path, monkeypatch, 0, gone, exitcode=1, at=4.0)
    summary, code = summarize_failure(errors.ChildFailedError("scaletrain", {0: other, 1: boom}))
    assert code == 1
    assert summary.count("Traceback") == 1 and 'raise ValueError("boom")' in summary
    assert summary.endswith("scaletrain: rank 1 failed with ValueError: boom (the traceback above "
                            "is that rank's; exit code 1)")  # fmt: skip
    data = json.loads((tmp_path / "error-1.json").read_text())
    assert data["message"]["extraInfo"]["timestamp"] == "5"  # torch's own format kept


def test_workers_without_our_records_get_the_generic_summary(tmp_path: Path) -> None:
    plain = errors.ProcessFailure(local_rank=0, pid=7, exitcode=3, error_file=str(tmp_path / "x"))
    summary, code = summarize_failure(errors.ChildFailedError("train.py", {0: plain}))
    assert code == 3 and summary.startswith("scaletrain launch: worker rank 0")
    assert "No error file" in summary
