"""The manifest that makes a checkpoint directory complete, and crash-safe file writes.

A checkpoint is a directory; `manifest.json` inside it lists every file with its
sha256 and size, and is written LAST, after every rank's files are on disk. So a
directory without a manifest is a save that did not finish (a crash, a kill, an
async save still running) and is ignored; one whose files do not match their
sha256 is damaged and refused. Every file is written under a temporary name in
the same directory, fsynced, renamed over its final name (atomic on POSIX), and
the directory is fsynced, so a crash leaves either the old file or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from scaletrain.errors import CheckpointError, say

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "FileEntry",
    "Manifest",
    "RejectedCheckpointError",
    "atomic_write",
    "atomic_write_bytes",
    "fsync_dir",
    "load_earlier",
    "read_manifest",
    "sha256_file",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT = "scaletrain-checkpoint"
FORMAT_VERSION = 1
"""Bumped when a reader of the old version could misread the new layout."""


class RejectedCheckpointError(CheckpointError):
    """This checkpoint cannot be used (unfinished, damaged, of a newer format), though
    an older one of the same run may: what a resume falls back over, saying why.

    `reason` is the cause alone, without the checkpoint's path or advice ("model.pt is
    truncated: 100 bytes, the manifest says 121523"): a list of rejected checkpoints
    names each path once and gives the advice once.
    """

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


def load_earlier() -> str:
    """The advice after a rejected checkpoint, in the words of the interface in use (the
    docs teach CheckpointManager.resume and `scaletrain checkpoint latest`)."""
    return say(
        api="load an earlier one (CheckpointManager(rt, RUN).resume(...) falls back to the "
        "newest undamaged one)",
        cli="load an earlier one (`scaletrain checkpoint latest RUN` prints the newest "
        "undamaged one)",
    )


_CHUNK = 1 << 22  # 4 MiB: large enough that hashlib releases the GIL while hashing


@dataclass(frozen=True, slots=True)
class FileEntry:
    """What the manifest records for one file."""

    sha256: str
    """Hex digest of the file's bytes."""
    size: int
    """Length in bytes: checked before the digest, so truncation is named as such."""

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.size}


@dataclass(kw_only=True, slots=True)
class Manifest:
    """Everything a loader checks before it reads a byte of the checkpoint's data."""

    kind: str
    """"full" (plain torch.save files written by rank 0) or "sharded" (DCP)."""
    world_size: int
    """Ranks that wrote it; per-rank state (RNG, sampler position) maps only to as many."""
    step: int | None = None
    """The `step` value saved with it, if any: shown in messages and directory names."""
    created_ns: int = field(default_factory=time.time_ns)
    """Wall clock of the save (rank 0): orders checkpoints for keep-K and latest."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    """Every file of the checkpoint but the manifest, with its digest and size."""
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Saved objects by the name they were given: kind, class and (models) fingerprint."""
    values: list[str] = field(default_factory=list)
    """Names of the plain values (kept in values.json)."""
    torch_version: str = torch.__version__

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "world_size": self.world_size,
            "step": self.step,
            "created_ns": self.created_ns,
            "torch_version": self.torch_version,
            "objects": self.objects,
            "values": self.values,
            "files": {name: entry.to_json() for name, entry in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, data: Any, where: Path) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            reason = f'its {where.name} is not a scaletrain manifest (no "format": "{FORMAT}")'
            raise RejectedCheckpointError(
                f"{where} is not a scaletrain checkpoint manifest (no "
                f'"format": "{FORMAT}" entry). Point at a directory written by '
                + say(api="rt.save", cli="scaletrain train")
                + ".",
                reason=reason,
            )
        version = data.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise RejectedCheckpointError(
                f"{where} has format version {version!r}; this scaletrain reads versions up "
                f"to {FORMAT_VERSION}. Upgrade scaletrain to load it.",
                reason=f"format version {version!r}, newer than this scaletrain reads "
                f"({FORMAT_VERSION}): upgrade scaletrain",
            )
        try:
            return cls(
                kind=str(data["kind"]),
                world_size=int(data["world_size"]),
                step=None if data.get("step") is None else int(data["step"]),
                created_ns=int(data["created_ns"]),
                torch_version=str(data.get("torch_version", "")),
                objects={str(k): dict(v) for k, v in data["objects"].items()},
                values=[str(v) for v in data["values"]],
                files={
                    str(name): FileEntry(sha256=str(e["sha256"]), size=int(e["bytes"]))
                    for name, e in data["files"].items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RejectedCheckpointError(
                f"{where} is damaged: {type(exc).__name__}: {exc}. The checkpoint cannot be "
                f"trusted; {load_earlier()}.",
                reason=f"its {where.name} is damaged ({type(exc).__name__}: {exc})",
            ) from exc


class _HashingWriter:
    """A write-only file object that hashes what passes through it.

    torch.save accepts any object with write(); hashing on the way out saves
    reading the file back.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where not supported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> FileEntry:
    """Write `path` through `write(file)` so that a crash leaves the old file or the new one.

    The bytes go to a temporary name in the same directory (same filesystem, so the
    rename is atomic), are fsynced, renamed over `path`, and the directory is fsynced.
    Returns the digest and size, computed while writing.
    """
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return FileEntry(sha256=writer.sha.hexdigest(), size=writer.size)


def atomic_write_bytes(path: Path, data: bytes) -> FileEntry:
    def write(f: IO[bytes]) -> None:
        f.write(data)

    return atomic_write(path, write)


def sha256_file(path: Path) -> FileEntry:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileEntry(sha256=sha.hexdigest(), size=size)


def read_manifest(ckpt: Path) -> Manifest:
    """The manifest of checkpoint directory `ckpt`, or a CheckpointError saying why not."""
    ckpt = Path(ckpt)
    where = say(
        api="Pass a directory rt.save wrote (e.g. runs/x/checkpoints/step-000100); "
        "CheckpointManager(rt, RUN).resume(...) finds the newest one of a run.",
        cli="Pass a checkpoint directory (RUN/checkpoints/step-000100); "
        "`scaletrain checkpoint latest RUN` prints the newest one of a run.",
    )
    if not ckpt.is_dir():
        what = "is a file, not a directory" if ckpt.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {ckpt} {what}. {where}")
    path = ckpt / MANIFEST
    if not path.is_file():
        inside = sorted(p.name for p in ckpt.iterdir())
        steps = [n for n in inside if n.startswith("step-")]
        if "checkpoints" in inside or steps:
            # A run's directory or its checkpoints/: no save began here. (An empty one
            # may be a save a kill cut short: that is said below.)
            what = (
                "is a run's directory (it holds checkpoints/)" if "checkpoints" in inside
                else f"holds checkpoints ({', '.join(steps[-2:])})"
            )  # fmt: skip
            raise CheckpointError(f"{ckpt} is not a checkpoint: it {what}. {where}")
        unfinished = (
            f"it has no {MANIFEST}, which is written last, so its save never finished "
            "(crash, kill, or an async save still running)"
        )
        raise RejectedCheckpointError(
            f"checkpoint {ckpt} is incomplete: {unfinished}; {load_earlier()}.",
            reason=unfinished,
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RejectedCheckpointError(
            f"{path} is unreadable ({type(exc).__name__}: {exc}); the checkpoint cannot be "
            f"trusted: {load_earlier()}.",
            reason=f"its {MANIFEST} is unreadable ({type(exc).__name__}: {exc})",
        ) from exc
    return Manifest.from_json(data, path)


def write_manifest(ckpt: Path, manifest: Manifest) -> FileEntry:
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=False) + "\n"
    return atomic_write_bytes(ckpt / MANIFEST, text.encode("utf-8"))


def verify_files(ckpt: Path, manifest: Manifest, names: Iterable[str]) -> list[str]:
    """Problems with `names` (missing, truncated, sha256 mismatch); empty when all match."""
    problems = []
    for name in names:
        entry = manifest.files[name]
        path = ckpt / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if size != entry.size:
            what = "truncated" if size < entry.size else "longer than written"
            problems.append(f"{name} is {what}: {size} bytes, the manifest says {entry.size}")
            continue
        if sha256_file(path).sha256 != entry.sha256:
            problems.append(f"{name} is corrupted: its sha256 differs from the manifest's")
    return problems
