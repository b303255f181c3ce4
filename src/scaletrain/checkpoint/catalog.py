"""The checkpoints of a run directory: where they live, which are valid, which may go.

A run keeps its checkpoints in RUN/checkpoints/step-000120/. A directory there with a
manifest is a checkpoint (valid, or damaged: a file truncated, corrupted or missing);
one without is a save that never finished. This module lists them with the reason
each one is refused, finds the newest valid one, and prunes old ones under one rule:
a checkpoint is deleted only when `keep` valid checkpoints newer than it exist and
this process wrote one of them, so a run whose newer checkpoints are damaged never
deletes the older ones it may need.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    RejectedCheckpointError,
    fsync_dir,
    read_manifest,
    verify_files,
)
from scaletrain.errors import CheckpointError, spell

__all__ = [
    "Found",
    "Retention",
    "checkpoint_path",
    "explain_no_checkpoint",
    "find_checkpoints",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_valid",
    "problem_with",
]


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """The conventional place for step `step`'s checkpoint: RUN/checkpoints/step-000120."""
    return Path(run_dir) / "checkpoints" / f"step-{int(step):06d}"


@dataclass(frozen=True, slots=True)
class Found:
    """A directory that is, or was meant to be, a checkpoint."""

    path: Path
    manifest: Manifest | None
    """None when the manifest is missing (an unfinished save) or unreadable."""
    problem: str | None
    """Why it cannot be loaded, without its path (None: it has a readable manifest; files
    not checked)."""
    order: tuple[int, str]
    """Sort key: when it was written (the manifest's clock, else the file's), then name."""

    @property
    def finished(self) -> bool:
        """Whether its save got as far as writing a manifest (readable or not)."""
        return (self.path / MANIFEST).is_file()


def _candidate_dirs(root: Path) -> list[Path]:
    dirs: list[Path] = []
    for parent in (root / "checkpoints", root):
        if parent.is_dir():
            dirs.extend(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    if (root / MANIFEST).is_file():
        dirs.append(root)
    return dirs


def _found(d: Path) -> Found:
    try:
        manifest = read_manifest(d)
    except CheckpointError as exc:
        # No manifest clock to go by: the time the directory last changed.
        where = d / MANIFEST if (d / MANIFEST).is_file() else d
        stamp = where.stat().st_mtime_ns
        why = exc.reason if isinstance(exc, RejectedCheckpointError) else str(exc)
        return Found(d, None, why, (stamp, d.name))
    return Found(d, manifest, None, (manifest.created_ns, d.name))


def list_checkpoints(root: str | os.PathLike[str]) -> list[Found]:
    """Every checkpoint-like directory under `root` (and root/checkpoints), oldest first.

    Directories of RUN/ itself count only with a manifest (a run directory holds other
    folders: pids/); under RUN/checkpoints/ every folder counts, an unfinished save too.
    """
    root = Path(root)
    out = []
    for d in _candidate_dirs(root):
        f = _found(d)
        if f.manifest is None and not f.finished and d.parent != root / "checkpoints":
            continue
        out.append(f)
    out.sort(key=lambda f: f.order)
    return out


def find_checkpoints(root: Path) -> list[tuple[Path, Manifest]]:
    """Directories under `root` (or root/checkpoints) with a readable manifest, oldest first."""
    return [(f.path, f.manifest) for f in list_checkpoints(root) if f.manifest is not None]


def problem_with(found: Found, *, verify: bool = True) -> str | None:
    """Why `found` cannot be loaded, or None: its manifest, then every file's size (and
    with `verify`, sha256)."""
    if found.manifest is None:
        return found.problem or "it has no manifest"
    manifest = found.manifest
    if verify:
        problems = verify_files(found.path, manifest, manifest.files)
    else:
        problems = [
            f"{name} is missing or has another size than the manifest says"
            for name, entry in manifest.files.items()
            if not (found.path / name).is_file() or (found.path / name).stat().st_size != entry.size
        ]
    return "; ".join(problems) if problems else None


def latest_checkpoint(run_dir: str | os.PathLike[str], *, verify: bool = True) -> Path | None:
    """The newest complete, undamaged checkpoint in `run_dir`, or None if there is none.

    Looks in `run_dir/checkpoints/*`, `run_dir/*` and `run_dir` itself. Newest is by
    the time rank 0 finished writing it (kept in the manifest, so copying a run
    keeps the order). Directories without a manifest (unfinished saves) are
    skipped; with `verify` (default) every file's sha256 is checked too and a
    damaged checkpoint is skipped for the one before it, which reads the whole
    checkpoint once; `verify=False` checks only that the files exist with the
    recorded sizes.
    """
    return newest_valid(run_dir, verify=verify)[0]


def newest_valid(
    run_dir: str | os.PathLike[str], *, verify: bool = True
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """latest_checkpoint, and the newer checkpoints it passed over (damaged, or saves
    that never finished), newest first, each with the reason: a command that falls
    back to an older checkpoint says which newer ones it skipped and why."""
    skipped: list[tuple[Path, str]] = []
    for found in reversed(list_checkpoints(run_dir)):
        problem = problem_with(found, verify=verify)
        if problem is None:
            return found.path, skipped
        skipped.append((found.path, problem))
    return None, skipped


def _series(name: str) -> str:
    return re.sub(r"\d+", "#", name)


@dataclass(slots=True)
class Retention:
    """Keep-K pruning that never deletes what a damaged newer checkpoint would still need.

    `written` are the checkpoints this process completed (valid: it wrote and hashed
    them); others are verified (sha256) the first time pruning depends on them, and
    the verdict is remembered, so each old checkpoint is read at most once.
    """

    keep: int | None
    written: set[Path] = field(default_factory=set)
    """Checkpoints this process completed."""
    loaded: set[Path] = field(default_factory=set)
    """Checkpoints this process verified while loading them (the one a run resumed from)."""
    verdicts: dict[tuple[Path, int], bool] = field(default_factory=dict)

    def trust(self, path: Path, *, written: bool = True) -> None:
        """Record `path` as a valid checkpoint: one this process wrote, or loaded."""
        (self.written if written else self.loaded).add(Path(path).resolve())

    def _valid(self, found: Found) -> bool:
        if found.path.resolve() in self.written | self.loaded:
            return True
        if found.manifest is None:
            return False
        key = (found.path.resolve(), found.manifest.created_ns)
        if key not in self.verdicts:
            self.verdicts[key] = problem_with(found) is None
        return self.verdicts[key]

    def prune(self, protect: Path) -> list[Path]:
        """After `protect` is complete: delete the checkpoints of its series (for
        step-000120: every step-NNNNNN beside it, never a `best/`) that are older than
        `keep` valid ones, one of which this process wrote.

        The manifest goes first: a deletion cut short leaves an incomplete directory,
        which loaders ignore. Directories without a manifest are left alone (one may
        be a save in progress), and so is any damaged checkpoint newer than the
        `keep`-th valid one.
        """
        self.trust(protect)
        if self.keep is None:
            return []
        parent, series = protect.parent, _series(protect.name)
        newest_first = [
            f
            for f in reversed(list_checkpoints(parent))
            if f.path.parent == parent and _series(f.path.name) == series and f.finished
        ]
        valid = 0
        ours_seen = False
        removed = []
        for found in newest_first:
            if valid >= self.keep and ours_seen and found.path.resolve() != protect.resolve():
                (found.path / MANIFEST).unlink(missing_ok=True)
                fsync_dir(found.path)
                shutil.rmtree(found.path, ignore_errors=True)
                removed.append(found.path)
                continue
            if self._valid(found):
                valid += 1
                ours_seen = ours_seen or found.path.resolve() in self.written
        return removed


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def explain_no_checkpoint(path: str | os.PathLike[str]) -> str:
    """What `path` is, for a person who expected a valid checkpoint in it and got none."""
    root = Path(path)
    if not root.exists():
        return f"{root} does not exist."
    if not root.is_dir():
        return f"{root} is a file, not a run or checkpoint directory."
    found = list_checkpoints(root)
    finished = [f for f in found if f.finished]
    if finished:
        lines = [
            f"  {f.path.name}: {problem_with(f) or 'valid (checked again now)'}"
            for f in reversed(finished)
        ]
        return (
            f"{root} is a run directory; found {len(finished)} checkpoints and rejected all "
            "of them:\n" + "\n".join(lines)
        )
    if found:
        return (
            f"{root} holds {len(found)} checkpoint save(s) that never finished (no "
            f"{MANIFEST}: a crash, a kill, or an async save still running): "
            + _listing([f.path.name for f in found])
            + "."
        )
    entries = sorted(p.name for p in root.iterdir())
    if not entries:
        return f"{root} is an empty directory: no run has written there."
    if (root / "model.pt").is_file() and (root / "metrics.jsonl").is_file():
        return (
            f"{root} is a finished run without checkpoints: its model.pt is already one "
            "plain state dict (torch.load(model.pt, weights_only=True)). A run saves "
            f"checkpoints with {spell('save_every')} N, and when it is stopped."
        )
    if (root / "metrics.jsonl").is_file() or (root / "config.json").is_file():
        return (
            f"{root} is a run directory without checkpoints (a run saves them with "
            f"{spell('save_every')} N, and when it is stopped)."
        )
    return f"{root} holds no checkpoint and is not a run directory (it holds {_listing(entries)})."
