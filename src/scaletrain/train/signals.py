"""Stop requests: SIGTERM, SIGUSR1 and a first Ctrl-C finish the step and save; a second Ctrl-C aborts.

SLURM sends SIGTERM (or the signal of `--signal=USR1@90`) before it kills a job;
a person presses Ctrl-C. Either way the work since the last checkpoint should not
be lost: the handler only sets a flag, the step in flight finishes, every rank
agrees on the step (a signal reaches ranks at different times) and saves. A second
Ctrl-C means "now": the process ends at once, without a traceback, and the last
complete checkpoint stays as it was (saves are atomic).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from scaletrain.exitcodes import EXIT_ABORTED

__all__ = ["StopRequest"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Installed for the duration of a run (main thread only); `.signal` is the first
    stop signal received, or None."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def reason(self) -> str:
        if self.signal is None:
            return ""
        name = signal.Signals(self.signal).name
        return "Ctrl-C" if self.signal == signal.SIGINT else f"signal {name}"

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            # Ctrl-C a second time: the user means now. No traceback, no save; the
            # checkpoints already written are complete (atomic writes) and stay.
            print(
                "\nscaletrain: second Ctrl-C: aborting without saving.", file=sys.stderr, flush=True
            )
            os._exit(EXIT_ABORTED)
        if self.signal is None:
            self.signal = signum
            if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
                print(
                    "\nscaletrain: Ctrl-C: finishing this step, then saving and stopping "
                    "(Ctrl-C again to abort without saving).",
                    file=sys.stderr,
                    flush=True,
                )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
