"""Output that never stops training: what only reports may fail, and training goes on.

A progress bar, a console log, a metrics file or TensorBoard scalars only report. When
what they write to goes away (`scaletrain train | head -3` closes the pipe; a terminal
closes; a redirect's disk fills up), the run loses that output, not its checkpoints
or its model: the failure is said once, on stderr while stderr is still open, else
nowhere, and training goes on.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Any

__all__ = ["LossyStream", "tell"]


def _to_devnull(stream: Any) -> None:
    """Point the descriptor under `stream` at /dev/null: what is still buffered for it,
    and Python's own flush at exit, then succeed instead of failing again (a failed
    flush at exit ends the process with code 120)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def tell(message: str) -> None:
    """`message` on stderr if it is still open; where it is not, nowhere (and stderr is
    pointed at /dev/null, so that nothing later fails on it)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(message + "\n")
        stream.flush()
    except (OSError, ValueError):
        _to_devnull(stream)


class LossyStream:
    """A text stream that never raises. The first write or flush that fails turns it
    off for the rest of the process, says so once (see `tell`), and points the
    descriptor at /dev/null; later writes are dropped. Anything else (isatty, encoding,
    fileno) is the wrapped stream's."""

    def __init__(
        self, stream: IO[str], name: str = "standard output", then: str = "Training goes on."
    ) -> None:
        self._stream = stream
        self.name = name
        self.then = then
        """What the message says happens next."""
        self.lost: str | None = None
        """Why the output was lost (None while it works)."""

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as exc:
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._lose(exc)

    def isatty(self) -> bool:
        try:
            return self.lost is None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _lose(self, exc: BaseException) -> None:
        self.lost = f"{type(exc).__name__}: {exc}"
        _to_devnull(self._stream)
        what = (
            "was closed (its reader stopped reading, as `| head` does)"
            if isinstance(exc, BrokenPipeError)
            else f"cannot be written ({self.lost})"
        )
        tell(f"scaletrain: {self.name} {what}: the rest of this output is lost. {self.then}")
