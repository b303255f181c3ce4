"""`st.launch(fn, nproc=N, args=...)`: a Python function on N processes, from Python.

The ranks are real processes started by torch's elastic agent in this process; the
functions they run are this module's (spawn imports them by name).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

import scaletrain as st
from scaletrain.testing import launcher_free_env, launcher_variables

pytestmark = pytest.mark.timeout(120)

SRC = str(Path(st.__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _as_a_fresh_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    # A suite run under a launcher (CI inside SLURM) must not hand its variables on.
    for name in [*launcher_variables(), "GLOO_SOCKET_IFNAME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _rank_report(base: int, init: bool) -> dict[str, Any]:
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    total = None
    if init:  # one job: the ranks meet
        with st.init(strategy="ddp") as rt:
            total = rt.reduce({"ranks": rt.rank}, op="sum")["ranks"]
    return {
        "rank": rank,
        "world": world,
        "value": base + rank,
        "total": total,
        "tensor": torch.full((2,), float(rank)),
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "master": os.environ.get("MASTER_ADDR"),
    }


def _fail_on_rank_1(message: str) -> str:
    with st.init(strategy="ddp") as rt:
        if rt.rank == 1:
            # Leaving the `with` block on an error shuts the group down first: rank 0
            # fails at once, and this rank says why only after (here, a second after).
            rt.shutdown(failed=True)
            time.sleep(1.0)
            raise ValueError(message)
        rt.barrier()  # rank 1 never comes: this rank fails because of it
        return "unreachable"


def _world() -> tuple[str | None, str | None]:
    return os.environ.get("RANK"), os.environ.get("WORLD_SIZE")


@pytest.mark.parametrize(("nproc", "init"), [(2, False), (3, True)])
def test_every_ranks_result_comes_back_in_rank_order(nproc: int, init: bool) -> None:
    import torch

    results = st.launch(_rank_report, nproc=nproc, args=(10, init))
    assert [r["rank"] for r in results] == list(range(nproc))
    assert [r["value"] for r in results] == [10 + r for r in range(nproc)]
    assert all(r["world"] == nproc for r in results)
    if init:
        assert all(r["total"] == sum(range(nproc)) for r in results)
    for rank, r in enumerate(results):
        assert torch.equal(r["tensor"], torch.full((2,), float(rank)))
    # scaletrain launch's environment: Gloo and the store on loopback.
    assert {(r["gloo"], r["master"]) for r in results} == {("lo", "127.0.0.1")}
    # Nothing of the launch is left in this process's environment.
    assert (
        "GLOO_SOCKET_IFNAME" not in os.environ
        and "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    )


def test_the_docs_example_runs(tmp_path: Path) -> None:
    from tests.docblocks import example

    (tmp_path / "launch_fn.py").write_text(example("launch-fn"))
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "launch_fn.py"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.fullmatch(r"final loss on each rank: \[([0-9.]+), ([0-9.]+)\]\n", done.stdout)
    assert match is not None and match.group(1) == match.group(2), done.stdout + done.stderr


def test_one_process() -> None:
    assert st.launch(_world, nproc=1) == [("0", "1")]


def test_an_exception_on_one_rank_is_one_error_naming_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(st.RankError) as info:
        st.launch(_fail_on_rank_1, nproc=2, args=("rank 1 cannot go on",))
    error = info.value
    assert isinstance(error, st.LaunchError)
    assert error.rank == 1 and error.exit_code == 1
    assert error.exc_type == "ValueError" and error.exc_message == "rank 1 cannot go on"
    assert isinstance(error.exception, ValueError) and str(error.exception) == "rank 1 cannot go on"
    message = str(error)
    assert message.startswith(
        "st.launch: rank 1 of 2 failed in _fail_on_rank_1: ValueError: rank 1 cannot go on"
    ), message
    # That rank's traceback, from the function on: not the launcher's wrapper.
    assert "in _fail_on_rank_1\n    raise ValueError(message)" in error.traceback
    assert error.traceback in message and "_rank_main" not in error.traceback
    # One error: no rank printed its own, torch's agent printed nothing.
    out, err = capfd.readouterr()
    for noise in ("Traceback", "ChildFailedError", "SIGTERM", "rank 1 cannot go on"):
        assert noise not in out + err, out + err
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is the caller's again


def _local_function() -> None:
    def inner() -> None:
        pass

    return inner  # type: ignore[return-value]


def _interactive_function(monkeypatch: pytest.MonkeyPatch) -> Any:
    # What a notebook cell defines: a function of a __main__ that has no file.
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("def train():\n    pass\n", namespace)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    return namespace["train"]


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda: 1, r"received a lambda .*a lambda has none\. Fix: define it with `def` at the top level"),
        (_local_function(), r"'_local_function.<locals>.inner', a function defined inside another function.*Fix: define it"),
        ("notebook", r"'train', defined in an interactive session \(a notebook.*Fix: define it"),
        ("not a function", r"received 'not a function' \(str\), which is not callable"),
    ],
)  # fmt: skip
def test_a_function_the_ranks_cannot_import_is_refused_before_any_process_starts(
    fn: Any, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.launcher.api

    def no_start(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the launcher was started")

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", no_start)
    if fn == "notebook":
        fn = _interactive_function(monkeypatch)
    with pytest.raises(st.ConfigError, match=expected) as info:
        st.launch(fn, nproc=2)
    assert info.value.field == "fn"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"nproc": 0}, r"st.launch\(nproc=0\) is not a process count\. Expected an integer >= 1"),
        ({"nproc": True}, r"st.launch\(nproc=True\) is not a process count"),
        ({"nproc": 2.0}, r"st.launch\(nproc=2.0\) is not a process count"),
        ({"args": 5}, r"args=...\) received 5 \(int\), not a tuple.*Fix: args=\(value,\)"),
        ({"args": (1, threading.Lock())}, r"args\[1\] \(lock\) cannot be sent to the ranks"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_are_refused_before_any_process_starts(
    kwargs: dict[str, Any], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.launcher.api

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", None)
    with pytest.raises(st.ConfigError, match=expected):
        st.launch(_world, **{"nproc": 2, **kwargs})


_SLEEPER = """
import os, sys, time
import scaletrain as st

def sleep(where):
    open(os.path.join(where, str(os.getpid())), "w").close()
    time.sleep(300)

def stop(where):
    # A loop of one's own that stops when asked and returns, as the docs teach.
    rt = st.init(strategy="ddp")
    for step in range(3000):
        time.sleep(0.1)
        if rt.should_stop():
            rt.shutdown()
            return step
        if step == 1:  # it has asked: SIGINT is a request to stop from here on
            open(os.path.join(where, str(os.getpid())), "w").close()

if __name__ == "__main__":
    try:
        st.launch(globals()[sys.argv[2]], nproc=2, args=(sys.argv[1],))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("work", "terminal"), [("sleep", False), ("stop", False), ("stop", True)])
def test_ctrl_c_ends_the_ranks(tmp_path: Path, work: str, terminal: bool) -> None:
    """A rank asleep ends on the forwarded SIGINT; one that asks rt.should_stop returns.
    A rank that returned waited for torch's agent to read its value, and its shutdown
    never did: st.launch ended 30 s after the ranks had stopped. `terminal`: Ctrl-C as a
    terminal sends it, to the whole foreground process group: the ranks, in sessions of
    their own, hear of it from the launcher alone (twice, it read as a second Ctrl-C)."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(_SLEEPER))
    pids = tmp_path / "pids"
    pids.mkdir()
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    # Its own session: the signal reaches the launching process only, as a notebook's
    # "interrupt the kernel" does; the ranks hear of it from the agent.
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pids), work],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(pids.iterdir())) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        ranks = [int(p.name) for p in pids.iterdir()]
        if terminal:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 3 and out == "interrupted\n", (out, err)
    assert "st.launch: Ctrl-C: asking the workers to stop" in err, err
    assert "Traceback" not in err and "second Ctrl-C" not in err, err
    # The agent's warnings repeated that line, one per worker.
    assert "death signal" not in err and "closing signal" not in err, err
    assert not [pid for pid in ranks if _alive(pid)]
    assert took < 20, f"st.launch ended {took:.1f} s after Ctrl-C"
