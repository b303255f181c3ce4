"""Processes the planner starts (probe ranks, fresh calibrations) and Ctrl-C.

Ctrl-C in a terminal interrupts its whole process group: the planner and every child
it spawned. The planner answers it (it kills its children and says "interrupted");
a child that got it too printed its own KeyboardInterrupt ("Process SpawnProcess-6:"
and a traceback, from wherever it was, importing torch or in a collective) over the
planner's one line. A child started while SIGINT is blocked in the starting thread
keeps it blocked from its first instruction (the mask is inherited through fork and
exec), so it never acts on one; the starter's own Ctrl-C stays pending meanwhile and
is delivered when the block ends, not lost.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["ctrl_c_held"]


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Block SIGINT in this thread while processes are started (module docstring);
    where signal masks do not exist (Windows), nothing is done."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        yield
        return
    old = mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)
