"""Ctrl-C in one process: held across an import that would lose it, and quick for a
worker that has nothing to save yet (issue 26). Each case runs in a fresh interpreter."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )


def test_a_ctrl_c_held_across_a_block_that_would_swallow_it_arrives_after() -> None:
    # `import torch` imports numpy from C++, which clears any error raised meanwhile: a
    # KeyboardInterrupt there was lost (3 of 40 Ctrl-Cs). Held, it arrives after.
    done = _python(
        "import os, signal, time\n"
        "from scaletrain.runtime.signals import ctrl_c_held\n"
        "with ctrl_c_held():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    try:\n"
        "        time.sleep(0.2)\n"
        "    except BaseException:\n"
        "        print('swallowed')\n"
        "    print('held')\n"
        "print('not interrupted')\n"
    )
    assert done.stdout == "held\n", done.stdout + done.stderr
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


def test_a_worker_ends_at_once_on_ctrl_c_until_it_has_a_run_to_save() -> None:
    code = (
        "import os, signal, time\n"
        "from scaletrain.runtime.signals import StopRequest\n"
        "stop = StopRequest().install(exit_until_armed=True)\n"
        "{arm}"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "print('stop requested by', stop.reason)\n"
    )
    quick = _python(code.format(arm=""))
    assert quick.returncode == -signal.SIGINT and quick.stdout == quick.stderr == ""
    armed = _python(code.format(arm="stop.arm()\n"))
    assert armed.returncode == 0 and armed.stdout == "stop requested by Ctrl-C\n"


def test_a_second_ctrl_c_runs_the_abort_hook_before_it_ends_the_process() -> None:
    done = _python(
        "import os, signal, time\n"
        "from scaletrain.runtime.signals import StopRequest\n"
        "StopRequest(on_abort=lambda: print('tidied', flush=True)).install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.1)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
    )
    assert done.returncode == 130 and done.stdout == "tidied\n", done.stdout + done.stderr
