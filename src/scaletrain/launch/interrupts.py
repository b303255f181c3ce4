"""Ctrl-C in a launcher, and the elastic agent's own log lines.

The workers run in sessions of their own, so a terminal's Ctrl-C reaches only the
launcher's process. `_Interrupts` handles it there: the first asks the workers to stop
(torch's own shutdown: the agent forwards it and waits for them to save), the second
kills them at once. `_quiet_agent` hides the agent's log lines where the launcher says
what happened in its own words. `scaletrain launch` (launcher.py) and `st.launch`
(function.py) both use them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from scaletrain.sigint import once_more

__all__: list[str] = []

_PROG = "scaletrain launch"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _child_pids() -> list[int]:
    """This process's children (the agent's workers), from /proc; [] where there is none."""
    me = os.getpid()
    children = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="utf-8") as f:
                    stat = f.read()
            except OSError:
                continue
            # Fields after the ")" that closes the command name: state, ppid, ...
            if int(stat.rpartition(")")[2].split()[1]) == me:
                children.append(int(entry.name))
    return children


class _Interrupts:
    """Ctrl-C in the launcher: the first asks the workers to stop, the second kills them.

    The workers run in sessions of their own (torch starts them so), so a terminal's
    Ctrl-C reaches only this process. The first one becomes torch's own shutdown with
    SIGINT: the agent forwards it and waits for the workers (a scaletrain worker
    finishes its step, saves and exits). The second one kills every worker's process
    group at once: the user means now. `workers` lists the processes it kills (all of
    this process's children by default) and `prog` names the launcher in its notice.

    `forward`: the first one is sent to the workers by this process instead, and the
    agent goes on watching them, for workers that are functions (st.launch): one that
    returns waits for the agent to read its value, which torch's shutdown never does
    (it waited 30 s for them, then killed them). Before any worker has started it is
    torch's shutdown all the same (none would get it).
    """

    def __init__(
        self, quiet: bool, *, prog: str = _PROG, workers: Callable[[], list[int]] | None = None,
        forward: bool = False,
    ) -> None:  # fmt: skip
        self.quiet = quiet
        self.prog = prog
        self.workers = workers or _child_pids
        self.forward = forward
        self.count = 0
        self._last: float | None = None
        self._previous: Any = None
        self._others: dict[signal.Signals, Any] = {}
        self._hushed: list[tuple[Any, int]] = []

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            # Until torch installs its own handlers (when the workers start), a stop
            # signal during the rendezvous would end this process silently.
            self._others = {sig: signal.signal(sig, self._stop) for sig in _STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        for sig, handler in self._others.items():
            signal.signal(sig, handler)
        for logger, level in self._hushed:
            logger.setLevel(level)

    @staticmethod
    def _stop(signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(
            f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum)
        )

    def _handle(self, signum: int, frame: Any) -> None:
        if once_more(self._last, time.monotonic()):  # the last Ctrl-C, delivered again
            return
        self._last = time.monotonic()  # and again as it is handled: a repeat inside counts
        self.count += 1
        if self.count == 1:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            if not self.quiet:
                print(
                    f"\n{self.prog}: Ctrl-C: asking the workers to stop (Ctrl-C again to kill them "
                    "now).",
                    file=sys.stderr,
                    flush=True,
                )
            # That line says it: the agent's warnings that it got the signal and passes
            # it on (one per worker) would say it again. Its errors still show.
            if not self.quiet:  # quiet: the agent's loggers are hidden already
                import logging

                self._hushed = _raise_levels(logging.ERROR)
            self._last = time.monotonic()  # handled: a repeat counts from here
            if self.forward and (workers := self.workers()):
                for pid in workers:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGINT)
                return
            raise SignalException("Ctrl-C", sigval=signal.SIGINT)
        for pid in self.workers():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        print(
            "\nscaletrain: second Ctrl-C: killed the workers; nothing more was saved.",
            file=sys.stderr,
            flush=True,
        )
        self._last = time.monotonic()


@contextlib.contextmanager
def _quiet_agent(
    quiet: bool, prefixes: Sequence[str] = ("torch.distributed.elastic",)
) -> Iterator[None]:
    """Hide the elastic agent's own log lines (workers' closing signals, its failure
    table) where the launcher prints its own summary of what happened; `prefixes` are
    the loggers hidden, with every logger below them."""
    if not quiet:
        yield
        return
    import logging

    saved = _raise_levels(logging.CRITICAL, prefixes)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def _raise_levels(
    level: int, prefixes: Sequence[str] = ("torch.distributed.elastic",)
) -> list[tuple[Any, int]]:
    """Set the loggers under `prefixes` to `level`; (logger, its level before) to restore.
    torch gives each elastic module a logger with its own level, so the parent's level
    is not enough: every one of them is raised."""
    import logging

    loggers = [logging.getLogger(prefix) for prefix in prefixes] + [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith(tuple(p + "." for p in prefixes)) and isinstance(logger, logging.Logger)
    ]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(level, logger.level))
    return saved
