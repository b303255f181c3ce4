"""How long the training thread waited for a CPU: Linux's per-thread schedstat.

`/proc/self/task/<tid>/schedstat` holds three numbers for one thread: nanoseconds on a
CPU, nanoseconds runnable but waiting in a run queue, and timeslices. The second is
what other processes (or the rank's own other threads) took from it: a rank whose
forward is 1.3x its peers' because the kernel ran something else on its core is not
slow on its device. The step ledger reads it once per window (a file read),
never per step; where /proc is missing (macOS) or does not hold it, the reader gives
None and nothing is said about CPU waits.
"""

from __future__ import annotations

import threading

__all__ = ["RunQueueClock", "schedstat"]


def schedstat(tid: int | None = None) -> tuple[int, int, int] | None:
    """(ns on a CPU, ns waiting in a run queue, timeslices) of thread `tid` of this
    process (the calling thread by default); None where the kernel does not say."""
    if tid is None:
        tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


class RunQueueClock:
    """The run-queue wait of the thread that made it (the training thread), in seconds.

    `lap()` gives the wait since the previous lap (None where it cannot be read), so the
    ledger gets one number per window from one read.
    """

    def __init__(self, tid: int | None = None) -> None:
        self.tid = threading.get_native_id() if tid is None else tid
        self._start = self._last = self.read()

    def read(self) -> float | None:
        """Seconds this thread has waited for a CPU so far (None: not known here)."""
        stat = schedstat(self.tid)
        return None if stat is None else stat[1] / 1e9

    @property
    def available(self) -> bool:
        return self._start is not None

    def lap(self) -> float | None:
        """Seconds waited since the previous lap (or since it was made)."""
        now = self.read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        return max(now - last, 0.0)

    def total(self) -> float | None:
        """Seconds waited since it was made."""
        now = self.read()
        if now is None or self._start is None:
            return None
        return max(now - self._start, 0.0)
