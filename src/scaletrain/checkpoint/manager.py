"""CheckpointManager: one run's checkpoints, from resume to the last save.

It owns what a training loop would otherwise spread around: the save interval, keep-K
pruning (with the memory of what it wrote and verified), async saving with its own
thread and Gloo group, and the resume rule:

* the newest checkpoint that loads is used; each newer one that did not is
  reported with the reason it was rejected (unfinished save, truncated file...);
* a folder that holds finished checkpoints of which none loads is an error that
  lists each one and why, and deletes nothing: a run never silently starts over
  on top of checkpoints it could not read.

    manager = CheckpointManager(rt, run_dir, every=100, keep=3, async_save=True)
    resumed = manager.resume(model=model, optimizer=opt, loader=loader)
    step = resumed.values["step"] if resumed.path else 0
    ...
    manager.maybe_save(step, model=model, optimizer=opt, loader=loader)
    manager.close()
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from scaletrain.checkpoint.asynchronous import AsyncSaver, PendingCheckpoint
from scaletrain.checkpoint.catalog import Found, Retention, checkpoint_path, list_checkpoints
from scaletrain.checkpoint.disks import check_splittable, find_disks
from scaletrain.checkpoint.layout import views
from scaletrain.checkpoint.load import load_with
from scaletrain.checkpoint.manifest import MANIFEST, RejectedCheckpointError
from scaletrain.checkpoint.save import check_keep, save_with
from scaletrain.checkpoint.scope import CheckpointScope, ScopeSource, as_scope
from scaletrain.dist.agreement import all_gather_objects
from scaletrain.errors import CheckpointError, ConfigError

__all__ = ["CheckpointManager", "Resumed"]


@dataclass(slots=True)
class Resumed:
    """What `resume()` found: the checkpoint loaded (None: none to load) and why newer
    ones were passed over."""

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    """The plain values saved with it (step, ...)."""
    rejected: list[tuple[Path, str]] = field(default_factory=list)
    """Newer checkpoints (or unfinished saves) that were not used, each with the reason."""


def _short(path: Path, folder: Path) -> str:
    """`path` relative to the run directory named just before it (checkpoints/step-000120)."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)


class CheckpointManager:
    """The checkpoints of the run in `folder` (kept in folder/checkpoints/step-NNNNNN)."""

    def __init__(
        self,
        source: CheckpointScope | ScopeSource,
        folder: str | os.PathLike[str],
        *,
        every: int | None = None,
        keep: int | None = None,
        async_save: bool = False,
    ) -> None:
        if isinstance(source, (str, os.PathLike)) or not (
            isinstance(source, CheckpointScope) or hasattr(source, "checkpoint_scope")
        ):
            raise ConfigError(
                f"CheckpointManager({type(source).__name__}, ...): the first argument is the "
                "Runtime (st.init's), the second the run's folder. Fix: "
                "CheckpointManager(rt, 'runs/mine')."
            )
        if not isinstance(folder, (str, os.PathLike)):
            raise ConfigError(
                f"CheckpointManager(rt, {type(folder).__name__}): the second argument is the "
                "run's folder, a str or Path. Fix: CheckpointManager(rt, 'runs/mine')."
            )
        check_keep(keep, "CheckpointManager")
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ConfigError(
                f"CheckpointManager(every={every!r}): expected an int >= 1 (steps between "
                "checkpoints) or None to save only when asked (force=True)."
            )
        self.scope = as_scope(source)
        self.folder = Path(folder)
        self.every = every
        self.async_save = async_save
        self._saver = AsyncSaver()
        self._retention = Retention(keep)
        topo = self.scope.topology
        self.disks = find_disks(self.folder, topo.rank, topo.world_size)
        """Which ranks share the folder's filesystem (see scaletrain.checkpoint.disks)."""

    def resume(self, *unnamed: Any, **state: Any) -> Resumed:
        """Load the newest checkpoint that loads into `state`; say what was passed over.

        A checkpoint that is unfinished, damaged or of a newer format is skipped for the
        one before it, with the reason; one that does not fit `state` (another model,
        optimizer or loader) is an error, not a reason to go back in time. Raises
        CheckpointError listing every checkpoint when the folder holds finished ones
        and none of them loads; nothing is deleted.
        """
        if unnamed:
            got = ", ".join(type(o).__name__ for o in unnamed)
            raise ConfigError(
                f"CheckpointManager.resume({got}): objects are passed by name (a load matches "
                "them by the names they were saved under). Fix: "
                "manager.resume(model=model, optimizer=optimizer, loader=loader)."
            )
        # Without a shared filesystem a model split across ranks is refused here, at
        # the start, rather than at its first save.
        modules = [m for m in views(self.scope, state).values() if isinstance(m, nn.Module)]
        check_splittable(self.disks, self.folder, modules, self.scope.topology.world_size)
        rejected: list[tuple[Path, str]] = []
        finished = 0
        for found in reversed(self._everywhere(list_checkpoints(self.folder), rejected)):
            finished += found.finished
            if found.manifest is None:
                rejected.append((found.path, found.problem or "it has no manifest"))
                continue
            try:
                values = load_with(
                    self.scope, found.path, state, saver=self._saver, disks=self.disks
                )
            except RejectedCheckpointError as exc:
                rejected.append((found.path, exc.reason))
                continue
            self._retention.trust(found.path, written=False)
            return Resumed(found.path, values, rejected)
        if finished:
            # Every directory passed over is listed, each path once with its reason alone,
            # and counted as what it is. (`finished` counts those every rank sees alike,
            # so every rank takes this branch or none does.)
            saved = sum((path / MANIFEST).is_file() for path, _ in rejected)
            unfinished = len(rejected) - saved
            also = f" (and {unfinished} save(s) that never finished)" if unfinished else ""
            listing = "\n".join(f"  {_short(path, self.folder)}: {why}" for path, why in rejected)
            raise CheckpointError(
                f"{self.folder} holds {saved} checkpoint(s){also} and none of them can be "
                f"loaded; nothing was deleted and the run did not start over from step 0:\n"
                f"{listing}\nFix: restore the files from a backup, or start a new run in "
                "another directory (the damaged ones stay here for inspection)."
            )
        return Resumed(None, {}, rejected)

    def _everywhere(self, found: list[Found], rejected: list[tuple[Path, str]]) -> list[Found]:
        """The checkpoints every rank sees, and sees the same (same manifest time): with a
        disk per node, a checkpoint is complete only when every node's part is. Every rank
        then tries the same ones in the same order."""
        world = self.scope.topology.world_size
        if world == 1:
            return found
        mine = [(f.path.name, f.manifest.created_ns if f.manifest else None) for f in found]
        views = [set(v) for v in all_gather_objects(mine, world)]
        common = set.intersection(*views)
        kept = []
        for f, key in zip(found, mine, strict=True):
            if key in common:
                kept.append(f)
                continue
            if key[1] is None:
                why = f"its save did not finish on this node's disk ({f.problem})"
            else:
                missing = [r for r, view in enumerate(views) if key not in view]
                why = f"ranks {missing} do not hold its part of it (their save did not finish)"
            rejected.append((f.path, why))
        return kept

    def due(self, step: int) -> bool:
        """Whether the interval asks for a checkpoint at `step`."""
        return self.every is not None and step > 0 and step % self.every == 0

    def maybe_save(
        self, step: int, /, *, force: bool = False, **state: Any
    ) -> Path | PendingCheckpoint | None:
        """Save into folder/checkpoints/step-NNNNNN when the interval says so (or `force`).

        `state` is as for save_checkpoint; the step is saved with it as the value
        `step`. An interval save is asynchronous when the manager is; a forced one (the
        last save, a stop) is complete when this returns. Returns the path, the handle
        of an async save, or None when nothing was due.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(
                f"CheckpointManager.maybe_save(step={step!r}, ...): expected the step, an int "
                ">= 0 (the checkpoint is named by it). Fix: manager.maybe_save(step, "
                "model=model, optimizer=optimizer, loader=loader)."
            )
        if not state:
            raise ConfigError(
                f"CheckpointManager.maybe_save({step}): nothing to save besides the step. Fix: "
                f"pass the state by name: manager.maybe_save({step}, model=model, "
                "optimizer=optimizer, loader=loader)."
            )
        if not (force or self.due(step)):
            return None
        handle = save_with(
            self.scope,
            checkpoint_path(self.folder, step),
            {**state, "step": step},
            saver=self._saver,
            retention=self._retention,
            async_save=self.async_save and not force,
            sharded=None,
            disks=self.disks,
        )
        return handle

    def wait(self) -> None:
        """Finish the saves in flight; raise CheckpointError if one failed."""
        self._saver.wait()

    def close(self) -> None:
        """Finish the saves in flight and stop the saving thread. Call on every rank."""
        self._saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.folder)!r}, every={self.every}, "
            f"keep={self._retention.keep}, async_save={self.async_save})"
        )
