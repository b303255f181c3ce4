"""A worker ends with its launcher: killing the agent (kill -9, the OOM killer) kills it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

SLEEPER = """\
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_worker_dies_with_a_killed_agent(tmp_path: Path, start: Callable[..., Any]) -> None:
    # Issue 10 (6): the worker went on as an orphan (torch starts workers in sessions of
    # their own and never tells them when the agent dies).
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pid_file = tmp_path / "worker.pid"
    agent = start("-m", "scaletrain.launch", "--nproc-per-node", "1", str(script), str(pid_file))
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    try:
        os.kill(agent.popen.pid, signal.SIGKILL)
        agent.popen.wait()  # (its pipes stay open while an orphan holds them)
        deadline = time.monotonic() + 10
        while _alive(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its agent"
            time.sleep(0.1)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
