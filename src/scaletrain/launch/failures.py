"""A failed worker, told once: the worker records its error, the launcher prints the first.

torch's elastic agent reads each failed worker's error file (the path is in
`TORCHELASTIC_ERROR_FILE`) and picks the first failure by its timestamp, in whole
seconds. A scaletrain worker (`record_failure`) writes torch's format plus its own
section: the failure time to the microsecond, the rank, whether it is a usage error
(exit 2) and the message as the user should read it. The launcher then prints that
one message (`summarize_failure`) instead of every rank's traceback and torch's
table: when rank 1 hits a bad setting, rank 0's "connection closed by peer" a moment
later is a consequence, not news.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from typing import Any

__all__ = ["record_failure", "summarize_failure"]

_PROG = "scaletrain launch"
_KEY = "scaletrain"


def record_failure(exc: BaseException, *, rank: int, usage: bool, exit_code: int) -> bool:
    """Write this worker's error file for the launcher (True if there is one to write).

    `usage` marks an error in the user's input, shown as its message alone; anything
    else is shown with its traceback.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time()
    stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(now))},
        },
        _KEY: {
            "time": now,
            "rank": rank,
            "usage": usage,
            "text": str(exc),
            "type": type(exc).__name__,
            "exit_code": exit_code,
            "traceback": stack,
        },
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def _ours(failure: Any) -> dict[str, Any] | None:
    data = getattr(failure, "error_file_data", None)
    if isinstance(data, dict) and isinstance(data.get(_KEY), dict):
        return data[_KEY]
    return None


def _failure_message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip()


def _exit_code(failure: Any) -> tuple[int, str]:
    exitcode = int(failure.exitcode)
    if exitcode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
        return 128 - exitcode, how
    return (exitcode if 0 < exitcode < 256 else 1), f"exited with code {exitcode}"


def summarize_failure(
    exc: Any, *, redirects: str = "0", log_dir: str | None = None, prog: str = _PROG
) -> tuple[str, int]:
    """What to print for a ChildFailedError, and the exit code to end with.

    Workers that recorded a scaletrain error: the earliest one's message (usage
    errors) or traceback (anything else), naming its rank; the rest are consequences.
    Other workers: torch's first failure, its exit code and its error file.
    """
    ours = {r: d for r, f in exc.failures.items() if (d := _ours(f)) is not None}
    if ours:
        rank = min(ours, key=lambda r: float(ours[r].get("time", 0.0)))
        data, failure = ours[rank], exc.failures[rank]
        code, _ = _exit_code(failure)
        if data.get("usage"):
            return f"scaletrain: error on rank {rank}: {data.get('text', '')}", code
        stack = str(data.get("traceback", "")).rstrip()
        lines = [stack] if stack else []
        lines.append(
            f"scaletrain: rank {rank} failed with {data.get('type', 'an error')}: "
            f"{data.get('text', '')} (the traceback above is that rank's; exit code {code})"
        )
        return "\n".join(lines), code

    rank, failure = exc.get_first_failure()
    code, how = _exit_code(failure)
    lines = [
        f"{prog}: worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}."
    ]
    others = sorted(r for r in exc.failures if r != rank)
    if others:
        lines.append(f"  Other failed ranks: {', '.join(map(str, others))}.")
    if os.path.isfile(failure.error_file):
        lines.append(f"  Error file: {failure.error_file}")
        message = _failure_message(failure)
        if message:
            lines.append(f"  Error: {message.splitlines()[-1]}")
    else:
        lines.append(
            "  No error file: the script did not write one. Decorate its entry point with "
            "@torch.distributed.elastic.multiprocessing.errors.record to get one."
        )
    if redirects != "0":
        lines.append(f"  The workers' output is in the log directory ({log_dir or 'temporary'}).")
    else:
        lines.append("  The worker's own output and traceback are above.")
    return "\n".join(lines), code
