"""Workers end with their launcher: a worker whose agent is killed is killed too.

torch's agent starts each worker in a session of its own and never tells it when
the agent dies. Kill one node's launcher (the OOM killer, `kill -9`, a node being
drained) and its workers go on training as orphans, their peers on the other
nodes go on with them, and when those finish, their agents wait torch's 300 s
exit barrier for an agent that is gone.

Linux has the fix: PR_SET_PDEATHSIG asks the kernel to signal a process when its
parent exits, and it survives execve. Each worker is therefore started through a
few lines of Python that set it, check that the agent has not died already, and
exec the real command: the worker is then exactly `python -u SCRIPT ARGS`, with no
wrapper left in its process or its tracebacks. Elsewhere than Linux the command
runs unguarded.

The signal is SIGKILL, not SIGTERM: a scaletrain worker answers SIGTERM by agreeing
on a step with its peers and saving, and an orphan's peers are dying or already
gone, so it would wait for them (measured: still waiting minutes later). The
job's checkpoints are what it resumes from; the other nodes' workers see the
connection close and fail at once, and their agents restart or end the job.

The same few lines hold Ctrl-C for a worker that is still starting. The agent
forwards a Ctrl-C to its workers as SIGINT; one that lands while a worker's
interpreter starts or imports prints a KeyboardInterrupt traceback from the middle
of an import, one per worker. The launcher therefore starts the workers with SIGINT
blocked (`sigint_held`; the mask survives fork and exec), and it stays pending: a
scaletrain worker (SIGINT_HELD set) lets it through once it can take it quietly
(`release_sigint`), and for any other program the guard lets it through just before
exec, where a pending one ends the guard silently, as for a C program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence

__all__ = ["GUARD", "SIGINT_HELD", "guarded_command", "release_sigint", "sigint_held"]

SIGINT_HELD = "SCALETRAIN_SIGINT_HELD"
"""Set for workers that let a held Ctrl-C through themselves (`release_sigint`)."""

GUARD = (
    "import ctypes, os, signal, sys\n"
    "agent = int(sys.argv[1])\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "if os.getppid() != agent:\n"
    "    sys.exit('scaletrain: the launcher ended before this worker started')\n"
    f"if not os.environ.get({SIGINT_HELD!r}):\n"
    "    signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
"""The worker's first code: `python -c GUARD AGENT_PID -u SCRIPT ARGS...`."""


def guarded_command(
    agent_pid: int, script: str, script_args: Sequence[str], *, module: bool
) -> tuple[str, list[str]]:
    """(entrypoint, args) for torchrun's --no-python mode that run `script` guarded."""
    if not _guarded():
        return sys.executable, ["-u", *(["-m"] if module else []), script, *script_args]
    run = ["-u", *(["-m"] if module else []), script, *script_args]
    return sys.executable, ["-c", GUARD, str(agent_pid), *run]


def _guarded() -> bool:
    return sys.platform.startswith("linux")


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Block SIGINT in this thread while it starts the workers, so that each starts with
    it blocked (see the module's docstring). Only where the guard runs, which lets it
    through again for workers that do not do so themselves."""
    if not _guarded():
        yield
        return
    from scaletrain.sigint import sigint_blocked

    with sigint_blocked():
        yield


def release_sigint() -> None:
    """In a worker started with SIGINT_HELD: take Ctrl-C from here on; one that arrived
    while it started raises KeyboardInterrupt now."""
    if os.environ.pop(SIGINT_HELD, None) and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
