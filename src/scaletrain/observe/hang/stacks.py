"""Where a rank is: its threads' Python stacks, the user's frame, its collective count.

Read from the watchdog's own thread while the training thread may be stuck, so
nothing here enters a collective or takes a lock the training thread could hold.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["dump_stacks"]

# Frames under torch/ are library internals: "where" names the innermost frame outside,
# which is the user's line. A main thread whose innermost frame is in torch/distributed/
# is blocked inside a collective (Gloo runs them synchronously on the caller's thread).
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep


def _locate(frame: FrameType | None) -> tuple[str, str]:
    """(where, collective) of a thread's innermost frame; see _TORCH_DIR."""
    if frame is None:
        return "", ""
    collective = ""
    if os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIST_DIR):
        collective = frame.f_code.co_name
    f: FrameType | None = frame
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_TORCH_DIR):
        f = f.f_back
    target = f if f is not None else frame
    where = (
        f"{os.path.basename(target.f_code.co_filename)}:{target.f_lineno} "
        f"in {target.f_code.co_name}"
    )
    return where, collective


def dump_stacks(
    path: Path | str | None = None,
    *,
    header: str = "",
    watched: int | None = None,
) -> str:
    """Every Python thread's stack, readable (source lines included), as text.

    The `watched` thread (an ident; default: the main thread) comes first. With `path`
    the text is also written there (parents created). Used on a hang; safe to call
    any time from any thread.
    """
    if watched is None:
        watched = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != watched, names.get(ident, "~")))
    chunks = [header.rstrip("\n") + "\n\n" if header else ""]
    for ident in order:
        role = " -- the training thread (it calls beat())" if ident == watched else ""
        if ident == threading.get_ident():
            role = role or " -- this thread, writing the dump"
        chunks.append(
            f"Thread {names.get(ident, '<not started by threading>')!r} "
            f"(ident {ident}){role}, most recent call last:\n"
        )
        chunks.append("".join(traceback.format_stack(frames[ident])))
        chunks.append("\n")
    text = "".join(chunks)
    if path is not None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return text


def _sequence_number() -> int | None:
    """Collectives this process issued on the default group, or None.

    Reads a counter of the group from this thread, never calls into a collective.
    """
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group: Any = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except Exception:
        return None
