"""scaletrain.testing.run_ranks: ranks forked from a forkserver that imported torch once
are still what spawned ranks were: processes of their own, each call's with the
caller's environment and standard output and error as they are at that call (not as
they were when the forkserver started)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from scaletrain.testing import RankFailure, run_ranks

pytestmark = pytest.mark.timeout(120)


def _seen(names: list[str]) -> tuple[dict[str, str | None], str, int, int]:
    seen = {name: os.environ.get(name) for name in names}
    return seen, tempfile.gettempdir(), os.getpid(), int(os.environ["RANK"])


def _speak() -> None:
    import sys

    rank = os.environ["RANK"]
    print(f"rank {rank} to stdout", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
    os.write(2, f"rank {rank} to fd 2\n".encode())


def _fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 says no")


def test_each_call_sees_the_callers_environment_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["SCALETRAIN_TEST_BEFORE", "SCALETRAIN_TEST_AFTER", "OMP_NUM_THREADS"]
    monkeypatch.setenv("SCALETRAIN_TEST_BEFORE", "1")
    first = run_ranks(_seen, 2, names)  # the forkserver may start here, with this environment
    assert [seen[0]["SCALETRAIN_TEST_BEFORE"] for seen in first] == ["1", "1"]
    later = tmp_path / "later"
    later.mkdir()
    monkeypatch.delenv("SCALETRAIN_TEST_BEFORE")
    monkeypatch.setenv("SCALETRAIN_TEST_AFTER", "2")
    monkeypatch.setenv("TMPDIR", str(later))
    second = run_ranks(_seen, 2, names, env={"OMP_NUM_THREADS": "1"})
    for seen, rank in zip(second, (0, 1), strict=True):
        assert seen[0] == {
            "SCALETRAIN_TEST_BEFORE": None,
            "SCALETRAIN_TEST_AFTER": "2",
            "OMP_NUM_THREADS": "1",
        }
        assert seen[1] == str(later)
        assert seen[3] == rank
    pids = [seen[2] for seen in first + second]
    assert len(set(pids)) == 4 and os.getpid() not in pids  # a process per rank per call


def test_a_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match="1 of 2 rank") as failure:
        run_ranks(_fail_on_rank_one, 2, timeout=60)
    assert "--- rank 1 ---" in str(failure.value) and "rank 1 says no" in str(failure.value)


def test_ranks_write_where_the_callers_output_goes_now(capfd: pytest.CaptureFixture[str]) -> None:
    """Each call's: a test's captured output (pytest's capfd redirects fds 1 and 2 for
    that test only) holds what its ranks printed."""
    for _ in range(2):  # the second call meets a running forkserver
        run_ranks(_speak, 2)
        out, err = capfd.readouterr()
        assert sorted(out.splitlines()) == ["rank 0 to stdout", "rank 1 to stdout"]
        for rank in (0, 1):
            assert f"rank {rank} to stderr" in err and f"rank {rank} to fd 2" in err, err
