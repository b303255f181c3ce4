"""Stop requests: SIGTERM, SIGUSR1 and a first Ctrl-C finish the step and save; a second Ctrl-C aborts.

SLURM sends SIGTERM (or the signal of `--signal=USR1@90`) before it kills a job;
a person presses Ctrl-C. Either way the work since the last checkpoint should not
be lost: the handler only sets a flag, the step in flight finishes, every rank
agrees on the step (a signal reaches ranks at different times) and saves. A second
Ctrl-C means "now": the process ends at once, without a traceback, and the last
complete checkpoint stays as it was (saves are atomic).

Before a worker of a launched job has formed its process group there is nothing to
save, and a rank that waits there inside C++ for a peer that a Ctrl-C already ended
runs no Python handler until its timeout: until `StopRequest.arm()`, Ctrl-C ends such
a worker at once (`install(exit_until_armed=True)`), and its launcher says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from scaletrain.exitcodes import EXIT_ABORTED
from scaletrain.sigint import ctrl_c_held, once_more, sigint_blocked

__all__ = ["StopRequest", "ctrl_c_held", "sigint_blocked"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Installed for the duration of a run (main thread only); `.signal` is the first
    stop signal received, or None."""

    def __init__(self, on_abort: Callable[[], None] | None = None, *, saving: bool = True) -> None:
        self.saving = saving
        """Whether the stop ends in a save (scaletrain train's), as its notice says; a loop
        of one's own that asks rt.should_stop() decides that itself."""
        self.signal: int | None = None
        self._last_ctrl_c: float | None = None
        self._previous: dict[int, Any] = {}
        self.on_abort = on_abort
        """Called before a second Ctrl-C ends the process (no `finally` runs then): what
        must not stay behind, such as this rank's pid file."""

    @property
    def reason(self) -> str:
        if self.signal is None:
            return ""
        name = signal.Signals(self.signal).name
        return "Ctrl-C" if self.signal == signal.SIGINT else f"signal {name}"

    def install(self, *, exit_until_armed: bool = False) -> StopRequest:
        """Take the stop signals from here on. `exit_until_armed`: Ctrl-C keeps its
        default action (the process ends at once, silently) until `arm()`."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _STOP_SIGNALS:
            quick = exit_until_armed and sig == signal.SIGINT
            self._previous[sig] = signal.signal(sig, signal.SIG_DFL if quick else self._handle)
        return self

    def arm(self) -> None:
        """There is a run to save from here on: Ctrl-C finishes the step and saves."""
        if signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and once_more(self._last_ctrl_c, time.monotonic()):
            return  # the last Ctrl-C, delivered again
        if signum == signal.SIGINT:
            self._last_ctrl_c = time.monotonic()
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            # Ctrl-C a second time: the user means now. No traceback, no save; the
            # checkpoints already written are complete (atomic writes) and stay.
            print(
                f"\nscaletrain: second Ctrl-C: aborting{' without saving' if self.saving else ''}.",
                file=sys.stderr,
                flush=True,
            )
            if self.on_abort is not None:
                with contextlib.suppress(Exception):
                    self.on_abort()
            os._exit(EXIT_ABORTED)
        if self.signal is None:
            self.signal = signum
            if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
                said = (
                    "stopping after this step or the next (the ranks agree on one), then "
                    "saving (Ctrl-C again to abort without saving)"
                    if self.saving
                    else "rt.should_stop() is True after this step or the next (the ranks "
                    "agree on one) (Ctrl-C again to end at once)"
                )
                print(f"\nscaletrain: Ctrl-C: {said}.", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
