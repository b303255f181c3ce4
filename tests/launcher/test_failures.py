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


def test_a_peer_the_agent_ends_after_a_preempted_exit_is_not_a_failure(tmp_path: Path) -> None:
    """Signalled workers save together and exit 75; when one exits first, the agent ends
    the other (SIGTERM: -15) while it is still closing. The launcher said "worker rank 1
    exited with code 75 ... No error file ... decorate its entry point" (seen in a CI
    run of tests/faults/test_own_loop.py)."""
    first = errors.ProcessFailure(local_rank=1, pid=8, exitcode=75, error_file=str(tmp_path / "a"))
    ended = errors.ProcessFailure(local_rank=0, pid=7, exitcode=-15, error_file=str(tmp_path / "b"))
    summary, code = summarize_failure(errors.ChildFailedError("loop.py", {1: first, 0: ended}))
    assert code == 75 and "stopped on a signal after saving" in summary, summary
    # A real failure beside a 75 is still one: an error, or a crash by a signal that is
    # not the agent's (a segfault: the agent then SIGTERMs the peer, which saves, 75).
    for bad in (1, -11, -6):
        crashed = errors.ProcessFailure(
            local_rank=0, pid=7, exitcode=bad, error_file=str(tmp_path / "c")
        )
        summary, _ = summarize_failure(errors.ChildFailedError("loop.py", {1: first, 0: crashed}))
        assert "stopped on a signal after saving" not in summary, (bad, summary)


def _unrecorded(rank: int, exitcode: int, tmp_path: Path) -> object:
    return errors.ProcessFailure(
        local_rank=rank, pid=200 + rank, exitcode=exitcode, error_file=str(tmp_path / f"no{rank}")
    )


def test_a_scaletrain_worker_without_a_record_is_the_cause_not_its_peers_echo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 26: rank 0 of `scaletrain train | head` ended without an error file; the
    launcher named rank 1's "connection closed by peer", or gave torch's @record advice."""
    gone = RuntimeError("[../gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]")
    echo = _failure(tmp_path, monkeypatch, 1, gone, exitcode=1, at=4.0)
    exc = errors.ChildFailedError("scaletrain", {0: _unrecorded(0, 120, tmp_path), 1: echo})
    summary, code = summarize_failure(exc, workers_record=True)
    assert code == 120
    assert summary.splitlines()[0] == (
        "scaletrain: rank 0 (pid 200) exited with code 120 without recording an error: Python "
        "ends with 120 when it cannot write out stdout or stderr at exit (the output was closed)."
    )
    assert "@record" not in summary and "Connection closed" not in summary


@pytest.mark.parametrize(
    ("exitcode", "words", "code"),
    [
        (-9, "killed by signal SIGKILL without recording an error: SIGKILL comes from the "
             "out-of-memory killer", 137),
        (-11, "a crash in native code", 139),
        (-6, "an abort in native code", 134),
        (86, "the hang watchdog ended it", 86),
    ],
)  # fmt: skip
def test_how_a_worker_ended_names_the_cause(
    tmp_path: Path, exitcode: int, words: str, code: int
) -> None:
    # Rank 1 ended by itself; rank 0 was stopped by the agent's SIGTERM afterwards.
    failures = {0: _unrecorded(0, -15, tmp_path), 1: _unrecorded(1, exitcode, tmp_path)}
    summary, got = summarize_failure(
        errors.ChildFailedError("scaletrain", failures), workers_record=True
    )
    assert summary.startswith("scaletrain: rank 1 (pid 201) ") and words in summary, summary
    assert "@record" not in summary and "Other failed ranks: 0" in summary
    assert got == code


def test_workers_that_saved_on_a_signal_are_not_a_failure_to_report(tmp_path: Path) -> None:
    failures = {r: _unrecorded(r, 75, tmp_path) for r in (0, 1)}
    summary, code = summarize_failure(
        errors.ChildFailedError("scaletrain", failures), workers_record=True
    )
    assert (summary, code) == ("", 75)


def test_a_scripts_workers_that_saved_on_a_signal_are_one_line_not_a_failure(
    tmp_path: Path,
) -> None:
    # A loop that stops on rt.should_stop() exits 75 on every rank; `scaletrain launch`
    # summarised that as worker rank 0's failure, with torch's @record advice.
    failures = {r: _unrecorded(r, 75, tmp_path) for r in (0, 1)}
    summary, code = summarize_failure(errors.ChildFailedError("own_loop.py", failures))
    assert code == 75
    assert summary == (
        "scaletrain launch: the workers stopped on a signal after saving (exit code 75); "
        "start the job again to resume."
    )
    # One worker that saved beside one that failed is a failure.
    failures[1] = _unrecorded(1, 1, tmp_path)
    summary, code = summarize_failure(errors.ChildFailedError("own_loop.py", failures))
    assert code in (1, 75) and "worker rank" in summary
