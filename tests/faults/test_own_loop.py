"""A loop of one's own stops as `scaletrain train` does (docs: "Your own loop").

examples/own_loop.py, the docs' example, under `scaletrain launch` at 2 Gloo ranks:
a SIGTERM to every worker (what SLURM sends before a preemption) or a Ctrl-C to the
launcher makes every rank save at the same step (rt.should_stop) and the job exit 75;
the same command then resumes and ends with the weights of an uninterrupted run,
bitwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.testing import launcher_free_env
from tests.docblocks import example
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"
EXIT_PREEMPTED = 75
STEPS = 1000


def _args(out: Path) -> list[str]:
    return ["launch", "--nproc-per-node", "2", str(EXAMPLE), "--out", str(out),
            "--steps", str(STEPS)]  # fmt: skip


def _start(out: Path) -> subprocess.Popen[str]:
    """The command in a process of its own: for the runs the test signals."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *_args(out)],
        cwd=out.parent,
        env=launcher_free_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _run(out: Path) -> tuple[int, str]:
    """The command run to its end with its launcher in this process (tests/inprocess.py):
    the workers are processes all the same, but not the launcher's import of torch."""
    done = run_cli(*_args(out), cwd=out.parent)
    return done.returncode, done.stdout + done.stderr


def _workers(launcher: int) -> list[int]:
    """The launcher's children: its workers (each started through the orphan guard,
    which exec()s the script in the same process)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == launcher:
                pids.append(int(entry.name))
    return pids


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {path} appeared:\n{_finish(proc)[1]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.01)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    code, log = _run(out)
    assert code == 0, log
    assert f"finished at step {STEPS}" in log
    return out


def test_the_docs_show_the_example_whole() -> None:
    assert example("own-loop") == EXAMPLE.read_text()


@pytest.mark.parametrize("to", ["workers", "launcher"])
def test_a_stopped_loop_saves_exits_75_and_resumes_bitwise(
    reference: Path, tmp_path: Path, to: str
) -> None:
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for(out / "checkpoints" / "step-000040" / "manifest.json", proc)
    if to == "workers":
        # What SLURM does before a preemption: signal every task of the job step.
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        reason = "signal SIGTERM"
    else:
        proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher
        reason = "Ctrl-C"
    code, log = _finish(proc)
    if code == 0:
        pytest.skip("the run finished before the signal arrived (machine too fast)")
    assert code == EXIT_PREEMPTED, log
    assert f"({reason}): saved; run again to resume" in log, log
    assert "Traceback" not in log, log
    assert "stopped on a signal after saving" in log and "exited with code 75" not in log, log
    if to == "launcher":
        # The launcher's own line says it asks the workers to stop; torch's agent said
        # so again, one warning per worker ("Received 2 death signal", "closing signal").
        assert "death signal" not in log and "closing signal" not in log, log
    stopped = int(log.split("stopped at step ")[1].split()[0])
    assert 40 < stopped < STEPS
    # Every rank saved the same step: the checkpoint is whole (its manifest is last).
    assert (out / "checkpoints" / f"step-{stopped:06d}" / "manifest.json").is_file()
    assert not (out / "model.pt").exists()

    code, log = _run(out)
    assert code == 0, log
    assert f"at step {stopped}" in log and "resumed from" in log, log
    assert f"finished at step {STEPS}" in log
    want, got = _weights(reference), _weights(out)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
