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
from collections.abc import Mapping
from typing import Any

__all__ = ["cause_of", "is_consequence", "preempted_note", "record_failure", "summarize_failure"]

_PROG = "scaletrain launch"
_KEY = "scaletrain"


# How Gloo and NCCL report a peer that went away: this rank fails because another
# did, so its error is a consequence, not the cause.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


def is_consequence(exc: BaseException) -> bool:
    """True for an error that only says another rank failed first."""
    from scaletrain.errors import PeerFailure

    if isinstance(exc, PeerFailure):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _PEER_GONE)


def record_failure(
    exc: BaseException,
    *,
    rank: int,
    usage: bool,
    exit_code: int,
    extra: Mapping[str, Any] | None = None,
) -> bool:
    """Write this worker's error file for the launcher (True if there is one to write).

    `usage` marks an error in the user's input, shown as its message alone; anything
    else is shown with its traceback. Errors that only report another rank's failure
    are marked as consequences, so the launcher shows the cause. `extra` adds entries
    (JSON values) to scaletrain's section of the record.
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
            "consequence": is_consequence(exc),
            **(extra or {}),
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


_NATIVE_CRASH = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
_FROM_OUTSIDE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _why_unrecorded(exitcode: int) -> str:
    """Why a scaletrain worker may end without an error file, read from how it ended."""
    from scaletrain.exitcodes import EXIT_ABORTED, EXIT_HANG, EXIT_PREEMPTED

    if exitcode == 120:
        return (
            "Python ends with 120 when it cannot write out stdout or stderr at exit (the "
            "output was closed)"
        )
    if exitcode == EXIT_HANG:
        return "the hang watchdog ended it; its diagnosis (`hang detected ...`) is above"
    if exitcode in (EXIT_PREEMPTED, EXIT_ABORTED):
        return "a signal stopped it"
    if exitcode >= 0:
        return "it ended in native code or through os._exit, before Python could record why"
    sig = -exitcode
    if sig == signal.SIGKILL:
        return (
            "SIGKILL comes from the out-of-memory killer (`dmesg` says so) or from a kill -9 "
            "by someone"
        )
    if sig == signal.SIGABRT:
        return "an abort in native code; the C++ reason (`terminate called ...`) is above"
    if sig in _NATIVE_CRASH:
        return "a crash in native code (torch, a library, a driver); its output above says where"
    if sig == signal.SIGPIPE:
        return "its output was closed"
    if sig in _FROM_OUTSIDE:
        return "a signal from outside the job stopped it"
    return "a signal ended it before Python could record why"


def _unrecorded_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """Of the failed ranks that recorded nothing, the likeliest cause: one that ended by
    itself rather than by a signal from outside (the agent's SIGTERM to the rest), then
    the earliest, then the lowest rank."""

    def key(item: tuple[int, Any]) -> tuple[bool, float, int]:
        rank, failure = item
        stopped = int(failure.exitcode) < 0 and -int(failure.exitcode) in _FROM_OUTSIDE
        return stopped, float(getattr(failure, "timestamp", 0) or 0), rank

    return min(failures.items(), key=key)


def preempted_note(prog: str = _PROG) -> str:
    """What a launcher says when every worker exited with EXIT_PREEMPTED (75)."""
    return (
        f"{prog}: the workers stopped on a signal after saving (exit code 75); start the "
        "job again to resume."
    )


def _earliest_cause(ours: Mapping[int, dict[str, Any]]) -> int:
    """The cause among the ranks that recorded an error: the earliest failure that is not
    just "a peer went away"; the earliest of any kind where every rank reports only that."""
    causes = {r: d for r, d in ours.items() if not d.get("consequence")} or ours
    return min(causes, key=lambda r: float(causes[r].get("time", 0.0)))


def cause_of(failures: Mapping[int, Any]) -> tuple[int, dict[str, Any] | None]:
    """The failed rank whose failure caused the others', with its record (None where it
    recorded nothing), for workers that record every Python error (`record_failure`):
    a rank that recorded a cause, else a rank that ended without a record (its peers
    only report that it went away), else the earliest recorded."""
    ours = {r: d for r, f in failures.items() if (d := _ours(f)) is not None}
    unrecorded = {r: f for r, f in failures.items() if r not in ours}
    if unrecorded and not any(not d.get("consequence") for d in ours.values()):
        return _unrecorded_cause(unrecorded)[0], None
    rank = _earliest_cause(ours)
    return rank, ours[rank]


def summarize_failure(
    exc: Any,
    *,
    redirects: str = "0",
    log_dir: str | None = None,
    prog: str = _PROG,
    workers_record: bool = False,
) -> tuple[str, int]:
    """What to print for a ChildFailedError ("" for nothing), and the exit code to end with.

    Workers that recorded a scaletrain error: the earliest one's message (usage
    errors) or traceback (anything else), naming its rank; the rest are consequences.
    A failed rank that recorded nothing, where the others only report that a peer went
    away, is the cause. Other workers: torch's first failure, its exit code and its
    error file.

    `workers_record`: the workers are scaletrain's own (`scaletrain train`), which
    record every Python error themselves; one that did not ended in a way no decorator
    catches (a signal, a crash in native code, an unwritable output at exit), and the
    message says which, instead of torch's advice to decorate the entry point.
    """
    from scaletrain.exitcodes import EXIT_PREEMPTED

    ours = {r: d for r, f in exc.failures.items() if (d := _ours(f)) is not None}
    unrecorded = {r: f for r, f in exc.failures.items() if r not in ours}
    codes = [int(f.exitcode) for f in exc.failures.values()]
    ended = (EXIT_PREEMPTED, -int(signal.SIGTERM), -int(signal.SIGKILL))  # the agent's
    if EXIT_PREEMPTED in codes and all(c in ended for c in codes):
        # Saved and stopped on a signal (scaletrain train's workers, rt.should_stop()
        # loops): not a failure. A rank that exits 75 has seen the save through on every
        # rank (it is collective); a peer still finishing when the agent noticed that
        # exit was then ended by the agent's SIGTERM (or its SIGKILL after), losing
        # nothing. Any other signal (a segfault, an abort) is a failure.
        # scaletrain train's rank 0 has said so itself.
        return ("" if workers_record else preempted_note(prog)), EXIT_PREEMPTED
    only_echoes = not any(not d.get("consequence") for d in ours.values())
    if workers_record and unrecorded and only_echoes:
        rank, failure = _unrecorded_cause(unrecorded)
        code, how = _exit_code(failure)
        lines = [
            f"scaletrain: rank {rank} (pid {failure.pid}) {how} without recording an error: "
            f"{_why_unrecorded(int(failure.exitcode))}."
        ]
        others = sorted(r for r in exc.failures if r != rank)
        if others:
            lines.append(
                f"  Other failed ranks: {', '.join(map(str, others))} (after it, or because of it)."
            )
        return "\n".join(lines), code
    if ours:
        rank = _earliest_cause(ours)
        data, failure = ours[rank], exc.failures[rank]
        code, _ = _exit_code(failure)
        # The code the worker chose: the agent may have sent it SIGTERM while it was
        # already on its way out (a peer's failure ends the group).
        code = int(data.get("exit_code") or code)
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
