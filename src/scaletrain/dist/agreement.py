"""Agree or fail on every rank: a local failure becomes the same error everywhere.

The same idea as `rank_first`: a step that can fail on one rank (a damaged file, a
full disk) is followed by one small all-gather of every rank's outcome, so the
failure raises on all ranks at once instead of leaving the others waiting in the
next collective until its timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from scaletrain.dist.collectives import control_group
from scaletrain.errors import ScaletrainError

__all__ = ["agree", "all_gather_objects", "attempt", "describe", "distributed"]

T = TypeVar("T")


def distributed(world_size: int) -> bool:
    """True when there are other ranks to agree with (a process group of several)."""
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, in rank order (just `[obj]` without other ranks)."""
    if not distributed(world_size):
        return [obj]
    out: list[Any] = [None] * world_size
    # On scaletrain's CPU group (see dist/collectives.py): no GPU involved, and its threads
    # are joined at rt.shutdown.
    dist.all_gather_object(out, obj, group=control_group())
    return out


def describe(exc: BaseException) -> str:
    """An exception in one line: our own errors by their message, others with their type."""
    if isinstance(exc, ScaletrainError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """(result, None), or (None, the error) if `fn` raised.

    Catches BaseException less KeyboardInterrupt/SystemExit: torch's DCP raises
    CheckpointException, a BaseException, which `except Exception` lets through
    (and then the other ranks would wait in the next collective).
    """
    try:
        return fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return None, exc


def agree(
    what: str,
    error: BaseException | None,
    payload: Any = None,
    *,
    world_size: int,
    wrap: Callable[[str], ScaletrainError],
) -> list[Any]:
    """All-gather (error, payload) from every rank; if any rank failed, raise on all.

    Returns every rank's payload when none failed. A rank's own ScaletrainError is
    re-raised as is when every failing rank reports the same thing (the usual case: a
    bad checkpoint looks bad to everyone); otherwise `wrap(message)` is raised, the
    message naming `what` failed and, when ranks differ, each failing rank's story.
    """
    gathered = all_gather_objects((None if error is None else describe(error), payload), world_size)
    failed = [(r, msg) for r, (msg, _) in enumerate(gathered) if msg is not None]
    if failed:
        messages = {msg for _, msg in failed}
        if error is not None and len(messages) == 1:
            if isinstance(error, ScaletrainError):
                raise error
            raise wrap(f"{what} failed: {describe(error)}") from error
        story = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise wrap(f"{what} failed on {len(failed)} rank(s): {story}") from error
    return [p for _, p in gathered]
