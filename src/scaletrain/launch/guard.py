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
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["GUARD", "guarded_command"]

GUARD = (
    "import ctypes, os, signal, sys\n"
    "agent = int(sys.argv[1])\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "if os.getppid() != agent:\n"
    "    sys.exit('scaletrain: the launcher ended before this worker started')\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
"""The worker's first code: `python -c GUARD AGENT_PID -u SCRIPT ARGS...`."""


def guarded_command(
    agent_pid: int, script: str, script_args: Sequence[str], *, module: bool
) -> tuple[str, list[str]]:
    """(entrypoint, args) for torchrun's --no-python mode that run `script` guarded."""
    if not sys.platform.startswith("linux"):
        return sys.executable, ["-u", *(["-m"] if module else []), script, *script_args]
    run = ["-u", *(["-m"] if module else []), script, *script_args]
    return sys.executable, ["-c", GUARD, str(agent_pid), *run]
