"""Full checkpoints: plain torch.save files, written whole by one rank, read with weights_only.

Used when every rank holds whole tensors (single process, DP, DDP, model
parallel): rank 0's copy is the model, so rank 0 writes it alone. Each file is
written atomically (manifest.atomic_write) and loaded with
`torch.load(weights_only=True)`, which builds tensors and plain containers only
and refuses any other object in the pickle instead of running its code.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.manifest import (
    FileEntry,
    RejectedCheckpointError,
    atomic_write,
    load_earlier,
)

__all__ = ["load_file", "save_file", "snapshot"]


def save_file(path: Path, obj: Any) -> FileEntry:
    """torch.save `obj` to `path` atomically; returns its sha256 and size."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def snapshot(obj: Any, *, clone: bool) -> Any:
    """`obj` with every tensor on the CPU; with `clone`, copies that later steps cannot change.

    CPU tensors make the files loadable anywhere (a GPU run resumed on a CPU box).
    An async save writes in the background while training goes on updating the
    parameters in place, so it must write copies taken now.
    """

    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if clone else t

    return _map_tensors(obj, to_cpu)


def _map_tensors(obj: Any, fn: Any) -> Any:
    """`obj` with `fn` applied to every tensor in its dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def load_file(path: Path) -> Any:
    """torch.load with weights_only=True onto the CPU; a refused or unreadable file is an error."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only raises UnpicklingError naming the global it refused to build.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        refused = (
            f"{path.name} holds objects other than tensors and plain values, and was refused "
            f"without running them (torch.load weights_only=True: {first})"
        )
        raise RejectedCheckpointError(
            f"{path.parent}/{refused}. scaletrain never writes such files: the checkpoint was "
            "altered or not written by scaletrain. Do not load it with weights_only=False "
            "unless you trust its author.",
            reason=refused,
        ) from exc
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as exc:
        unreadable = f"{path.name} cannot be read ({type(exc).__name__}: {exc})"
        raise RejectedCheckpointError(
            f"{path.parent}/{unreadable}. The checkpoint is damaged; {load_earlier()}.",
            reason=unreadable,
        ) from exc
