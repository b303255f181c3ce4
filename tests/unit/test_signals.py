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
    # KeyboardInterrupt there was lost (3 of 40 Ctrl-Cs). Held, it arrives after. The
    # hold imports no torch: the CLI holds Ctrl-C before torch's import begins (from
    # scaletrain.runtime it came after the import it was to hold).
    done = _python(
        "import os, signal, time\n"
        "import sys\n"
        "from scaletrain.sigint import ctrl_c_held\n"
        "assert 'torch' not in sys.modules, 'holding Ctrl-C imported torch'\n"
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
        "time.sleep(0.5)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
    )
    assert done.returncode == 130 and done.stdout == "tidied\n", done.stdout + done.stderr


@pytest.mark.parametrize("where", ["one process", "launcher"])
def test_one_ctrl_c_delivered_twice_is_one_ctrl_c(where: str) -> None:
    """`timeout -s INT` sends its SIGINT to the command and then to its process group
    (the command again): the launcher took the two as a second Ctrl-C, killed the
    workers mid-save and left a checkpoint without its manifest. Two within
    ONE_CTRL_C_S are one; a press after that is the second."""
    if where == "one process":
        setup = (
            "from scaletrain.runtime.signals import StopRequest\n"
            "StopRequest(on_abort=lambda: print('aborted', flush=True)).install()\n"
        )
    else:  # the agent's stop (SignalException) caught here; killing the workers said
        setup = (
            "from scaletrain.launch.interrupts import _Interrupts\n"
            "_Interrupts(quiet=True, workers=lambda: print('aborted', flush=True) or []"
            ").__enter__()\n"
        )
    done = _python(
        "import os, signal, time\n"
        + setup
        + "def press():  # one delivery, handled, then the same again\n"
        "    for _ in range(2):\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(0.02)\n"
        "        except BaseException as exc:\n"
        "            print('stopping:', type(exc).__name__, flush=True)\n"
        "press()\n"
        "print('one Ctrl-C', flush=True)\n"
        "time.sleep(0.5)\n"
        "press()\n"
        "time.sleep(0.5)\n"
        "print('went on', flush=True)\n"
    )
    lines = done.stdout.splitlines()
    assert "one Ctrl-C" in lines, done.stdout + done.stderr
    first, second = lines[: lines.index("one Ctrl-C")], lines[lines.index("one Ctrl-C") + 1 :]
    assert "aborted" not in first, done.stdout + done.stderr
    assert second == (["aborted", "went on"] if where == "launcher" else ["aborted"]), done.stdout


_LOOP = (
    "import os, signal, time\n"
    "import scaletrain as st\n"
    "rt = st.init(strategy='single', ledger=False)\n"
    "try:\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    time.sleep(1)\n"
    "except KeyboardInterrupt:\n"
    "    print('before the first should_stop: KeyboardInterrupt', flush=True)\n"
    "for step in range(1, 10):\n"
    "    if step == 2:\n"
    "        os.kill(os.getpid(), signal.{sig})\n"
    "    if rt.should_stop():\n"
    "        break\n"
    "print('stopped after step', step, 'by', rt.stop_reason, rt.should_stop(), flush=True)\n"
    "rt.shutdown()\n"
)


@pytest.mark.parametrize(("sig", "reason"), [("SIGINT", "Ctrl-C"), ("SIGUSR1", "signal SIGUSR1")])
def test_should_stop_in_one_process(sig: str, reason: str) -> None:
    """A loop's own stop (rt.should_stop) in one process, without a process group: the
    signal's step is finished, the next one says stop (the agreement comes one step
    later, as at any world size). Before the first call Ctrl-C is Python's own."""
    done = _python(_LOOP.replace("{sig}", sig))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == (
        f"before the first should_stop: KeyboardInterrupt\nstopped after step 3 by {reason} True\n"
    ), done.stdout + done.stderr
    if sig == "SIGINT":
        # A loop of one's own decides whether it saves: the notice promises no save.
        assert done.stderr.count("scaletrain: Ctrl-C: ") == 1, done.stderr
        assert (
            "scaletrain: Ctrl-C: rt.should_stop() is True after this step or the next (the "
            "ranks agree on one) (Ctrl-C again to end at once)." in done.stderr
        ), done.stderr
        assert "saving" not in done.stderr, done.stderr


def test_shutdown_gives_the_signals_back_when_nothing_stopped_the_loop() -> None:
    done = _python(
        "import signal\n"
        "import scaletrain as st\n"
        "rt = st.init(strategy='single', ledger=False)\n"
        "assert rt.should_stop() is False\n"
        "assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL\n"
        "rt.shutdown()\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,\n"
        "      signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    assert done.stdout == "True True\n", done.stdout + done.stderr
