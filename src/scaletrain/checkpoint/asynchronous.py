"""Saving in the background: the saver that owns the thread, its Gloo group and the handles.

An `AsyncSaver` runs the second half of an async save (the writes, then the
manifest) on one worker thread, so saves finish in the order they started; it also
owns the Gloo group DCP's background collectives use. A CheckpointManager owns one;
the one-shot functions (`save_checkpoint(async_save=True)`, `wait_pending()`) share
`default_saver()`, made on first use, because `wait_pending()` is their contract.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scaletrain.checkpoint.catalog import Retention
from scaletrain.dist.agreement import describe, distributed
from scaletrain.dist.collectives import gloo_group
from scaletrain.errors import CheckpointError

__all__ = ["AsyncSaver", "PendingCheckpoint", "default_saver", "wait_pending"]


class PendingCheckpoint:
    """An async save in flight. `wait()` / `result()` finish it and return its path.

    On rank 0 the checkpoint is complete (manifest written, old ones pruned) once
    `wait()` returns; on other ranks `wait()` returns when this rank's part is
    written. The next save or load through the same saver waits for it on its own.
    """

    def __init__(self, path: Path, future: Future[Path]) -> None:
        self.path = path
        self._future = future
        self.reported = False
        """Whether its failure already reached the user (through result())."""

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        except CheckpointError:
            self.reported = True
            raise
        except Exception as exc:
            self.reported = True
            raise CheckpointError(
                f"the async save to {self.path} failed: {describe(exc)}. The checkpoints "
                "saved before it are untouched."
            ) from exc

    def wait(self, timeout: float | None = None) -> Path:
        return self.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"PendingCheckpoint({str(self.path)!r}, {state})"


class AsyncSaver:
    """One background thread for the writes, one Gloo group for DCP, the saves in flight."""

    def __init__(self) -> None:
        self._pending: list[PendingCheckpoint] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._group: tuple[Any, Any] | None = None
        # What pruning knows: checkpoints written here, verdicts on the others.
        self._written: set[Path] = set()
        self._verdicts: dict[tuple[Path, int], bool] = {}

    def retention(self, keep: int | None) -> Retention:
        """Keep-K pruning that remembers, across saves, what this saver wrote and verified."""
        return Retention(keep, written=self._written, verdicts=self._verdicts)

    def submit(self, path: Path, finish: Callable[[], Path]) -> PendingCheckpoint:
        """Run `finish` on the saver's thread; the handle is waited for by `settle`."""
        if self._executor is None:
            # One worker: saves finish in the order they were started.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scaletrain-ckpt")
        handle = PendingCheckpoint(path, self._executor.submit(finish))
        with self._lock:
            self._pending.append(handle)
        return handle

    def group(self, world_size: int) -> Any:
        """A Gloo group for DCP's background-thread collectives (made once per process group).

        Collectives from two threads on one group can interleave differently on
        different ranks and deadlock; torchtitan gives async checkpointing its own
        group for the same reason. Gloo also because dcp.async_save needs a CPU backend.
        """
        if not distributed(world_size):
            return None
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:
            self._group = (world, gloo_group())
        return self._group[1]

    def settle(self) -> str | None:
        """Wait for every save in flight; the first failure not yet reported, if any."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        first: str | None = None
        for handle in pending:
            reported = handle.reported
            try:
                handle.result()
            except CheckpointError as exc:
                if not reported and first is None:
                    first = str(exc)
        return first

    def wait(self) -> None:
        """Finish every save in flight; raise CheckpointError if one failed unreported."""
        error = self.settle()
        if error is not None:
            raise CheckpointError(error)

    def close(self) -> None:
        """Finish the saves in flight, then stop the thread (the group goes with the job)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


_DEFAULT: AsyncSaver | None = None


def default_saver() -> AsyncSaver:
    """The saver of the one-shot functions (save_checkpoint, load_checkpoint, wait_pending)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = AsyncSaver()
    return _DEFAULT


def wait_pending() -> None:
    """Finish every async save started by `save_checkpoint` in this process.

    Raises CheckpointError if one failed. Call before the process group is destroyed
    (rt.shutdown() does): a sharded async save still needs it.
    """
    if _DEFAULT is not None:
        _DEFAULT.wait()
