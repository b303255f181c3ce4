"""Ctrl-C: the first one finishes the step, saves and stops; a second one aborts at once.

The signal goes where a terminal sends it: to `scaletrain train` itself (its workers
run in sessions of their own, so the terminal's Ctrl-C reaches only the launcher).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scaletrain.sigint import ONE_CTRL_C_S
from scaletrain.testing import launcher_free_env, write_fake_mnist
from tests.inprocess import run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EXIT_PREEMPTED, EXIT_ABORTED = 75, 130


def _args(out: Path, data: Path, *extra: str) -> list[str]:
    return [
        "train", "--data-dir", str(data), "--out", str(out), "--batch-size", "10",
        "--log-every", "1", "--epochs", "3", "--hang-timeout", "60", *extra,
    ]  # fmt: skip


class _Run:
    """A `scaletrain train` process whose output is read as it comes."""

    def __init__(self, out: Path, data: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scaletrain", *_args(out, data, *extra)],
            cwd=out.parent,
            env=launcher_free_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"run ended before {text!r}:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not seen in {timeout} s:\n{self.output}")
            time.sleep(0.02)

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 3 epochs of 2,400 samples at batch 10 x 2 ranks: 360 steps, far more than the
    # test waits for before it presses Ctrl-C.
    return write_fake_mnist(tmp_path_factory.mktemp("data"), n_train=2400, n_test=40, seed=7)


def _assert_clean(output: str) -> None:
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "torch.distributed.elastic"):
        assert noise not in output, output


@pytest.mark.parametrize("nproc", ["2", "1"])
def test_first_ctrl_c_saves_and_the_same_command_resumes(
    data: Path, tmp_path: Path, nproc: str
) -> None:
    out = tmp_path / "run"
    run = _Run(out, data, "--nproc", nproc)
    run.wait_for("epoch 1/3 step 3/")
    run.proc.send_signal(signal.SIGINT)
    code = run.finish()
    assert code == EXIT_PREEMPTED, run.output
    assert "Run the same command again to resume" in run.output
    _assert_clean(run.output)
    saved = sorted((out / "checkpoints").glob("step-*/manifest.json"))
    assert saved, run.output
    step = int(saved[-1].parent.name.split("-")[1])
    assert step >= 3
    # The same command (its launcher, or its one process, in this one: tests/inprocess.py).
    done = run_cli(*_args(out, data, "--nproc", nproc, "--max-steps", str(step + 2)))
    again = done.stdout + done.stderr
    assert done.returncode == 0, again
    # A new --max-steps: the header says the run was shortened (issue 8).
    planned = 360 * 2 // int(nproc)  # 3 epochs of 2,400 samples at batch 10 per rank
    assert f"resumed at step {step}, shortening to {step + 2} (it was {planned})" in again
    assert f"from {saved[-1].parent}" in again


@pytest.mark.parametrize("nproc", ["2", "1"])
def test_second_ctrl_c_aborts_at_once(data: Path, tmp_path: Path, nproc: str) -> None:
    out = tmp_path / "run"
    run = _Run(out, data, "--nproc", nproc, "--batch-size", "200")
    run.wait_for("epoch 1/3 step 2/")
    run.proc.send_signal(signal.SIGINT)
    # A person presses twice; two signals sent back to back would reach Python as one,
    # and one within ONE_CTRL_C_S of the first is that one delivered again. The second
    # press lands while the workers finish their step and save.
    run.wait_for("stopping after this step or the next")
    time.sleep(ONE_CTRL_C_S)
    run.proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    code = run.finish(timeout=60)
    elapsed = time.monotonic() - start
    assert code == EXIT_ABORTED, run.output
    assert elapsed < 20, f"took {elapsed:.1f} s to abort"
    assert "second Ctrl-C" in run.output
    _assert_clean(run.output)
    # Workers killed at once cannot remove their pid files: the launcher (or, in one
    # process, the abort itself) removes them (issue 26: pids/ stayed).
    assert not (out / "pids").exists(), sorted(p.name for p in (out / "pids").iterdir())


def test_second_ctrl_c_after_the_save_still_aborts(data: Path, tmp_path: Path) -> None:
    """issue 26: pressed after the workers saved (they were on their way out), the
    second Ctrl-C exited 75, "saved, try again", instead of 130."""
    out = tmp_path / "run"
    run = _Run(out, data, "--nproc", "2")
    run.wait_for("epoch 1/3 step 3/")
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("Run the same command again to resume")  # saved; the workers exit
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=60)
    if "second Ctrl-C" not in run.output:
        pytest.skip("the launcher ended before the second Ctrl-C arrived (machine too fast)")
    assert code == EXIT_ABORTED, run.output
    assert sorted((out / "checkpoints").glob("step-*/manifest.json"))  # the save stays
    _assert_clean(run.output)
    assert not (out / "pids").exists()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("when", ["launcher-starting", "workers-starting"])
def test_ctrl_c_during_start_up_says_interrupted_once(
    data: Path, tmp_path: Path, when: str
) -> None:
    """issue 26: pressed while the workers started, each printed "interrupted" (or a
    KeyboardInterrupt traceback from the middle of an import)."""
    out = tmp_path / "run"
    run = _Run(out, data, "--nproc", "2")
    deadline = time.monotonic() + 60
    if when == "launcher-starting":
        time.sleep(0.3)
    else:
        # The moment the agent has started its workers: they are starting Python.
        while not _children(run.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=60)
    assert code == EXIT_ABORTED, run.output
    assert run.output.count("interrupted") == 1, run.output
    assert run.output.strip() == "scaletrain: interrupted.", run.output
    assert not out.exists() or not (out / "pids").exists()


def test_ctrl_c_while_plan_profiles_a_model_says_interrupted_once(tmp_path: Path) -> None:
    """A Ctrl-C inside torch's dispatch (the plan's fake step) crossed C++ frames and
    aborted the process ("terminate called after throwing an instance of
    'python_error'"); it is held to the next block boundary and said once."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "plan", "--recipe", "llama-8b", "--devices", "8",
         "--hardware", "h100-sxm"],
        cwd=tmp_path, env=launcher_free_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    time.sleep(8)  # imports, then the 8B's fake step, which takes minutes
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert err.count("interrupted") == 1 and "terminate called" not in err, err
