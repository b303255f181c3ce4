"""Holding Ctrl-C for a block: SIGINT blocked, so one pressed meanwhile arrives when the
block ends. Imports nothing but the standard library, so the CLI can hold Ctrl-C
before torch's import begins (scaletrain.runtime imports torch)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["ONE_CTRL_C_S", "ctrl_c_held", "once_more", "sigint_blocked"]

ONE_CTRL_C_S = 0.1
"""A SIGINT this soon after the one before is the same Ctrl-C delivered again, not a second
press: `timeout -s INT` sends it to its command and then to its process group (the
command again), as a `kill -INT` of a job's process group and a launcher's forwarding
do, microseconds apart. A person's second press comes later."""


def once_more(last: float | None, now: float) -> bool:
    """Whether a SIGINT at `now` (time.monotonic) repeats the one handled at `last`
    (None: none was), by ONE_CTRL_C_S."""
    return last is not None and now - last < ONE_CTRL_C_S


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in the calling thread for the block (where the platform can): one
    that arrives meanwhile stays pending until it ends, and processes started inside
    the block inherit the mask."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C (block SIGINT in this, the main, thread) for the block; one pressed
    meanwhile arrives when it ends. For `import torch`: a module it imports catches
    KeyboardInterrupt, so a Ctrl-C during the import could be lost and the run went on
    as if nothing had been pressed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with sigint_blocked():
        yield
