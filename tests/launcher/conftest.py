"""Fixtures for the launcher tests: free ports, a clean environment, subprocess runners."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import scaletrain.launch

# The directory that holds the `scaletrain` package under test, for child processes.
SRC = str(Path(scaletrain.launch.__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def child_env(tmp_path: Path) -> dict[str, str]:
    """Environment for launcher subprocesses: package importable, one thread, loopback Gloo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"
    # torchelastic's temporary log dirs and error files land here, not in /tmp.
    env["TMPDIR"] = str(tmp_path)
    env.pop("SCALETRAIN_RDZV_ID", None)
    return env


class Proc:
    """A launcher started in its own session, so a hung one is killed with its workers."""

    def __init__(self, args: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            out, err = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            out, err = self.popen.communicate()
            pytest.fail(f"launcher timed out after {timeout}s; stderr:\n{err}")
        return subprocess.CompletedProcess(self.popen.args, self.popen.returncode, out, err)


@pytest.fixture
def start(child_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """start("-m", "scaletrain.launch", ...) -> Proc; every Proc is reaped at teardown."""
    procs: list[Proc] = []

    def _start(*args: str) -> Proc:
        proc = Proc(args, child_env, tmp_path)
        procs.append(proc)
        return proc

    yield _start
    for proc in procs:
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.communicate()
