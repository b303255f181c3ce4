"""Sharded checkpoints through torch.distributed.checkpoint (DCP), read without running pickles.

Used when ranks hold different pieces of the model (FSDP, tensor parallel,
pipeline stages): every rank writes its own shards in parallel, and DCP reshards
on load, so a checkpoint saved on 2 ranks loads on 4, or in one process with no
process group at all.

DCP itself reads its `.metadata` with `pickle.load` and non-tensor values with
`torch.load(weights_only=False)` (torch 2.13, filesystem.py / default_planner.py):
a doctored checkpoint could run code on load. The reader and planners here use
a restricted unpickler for the metadata (only DCP's own metadata classes,
torch.Size, dtypes and paths may be built) and `weights_only=True` for values.

Only DCP's public API is used (save, load, async_save, the planner and storage
classes), so the module works across the torch versions pyproject allows: whole
tensors are read without a model by giving dcp.load empty tensors shaped from the
metadata, and the state dict is flattened here rather than with DCP's private helper.
"""

from __future__ import annotations

import io
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from scaletrain.checkpoint.manifest import load_earlier
from scaletrain.errors import CheckpointError, article

__all__ = [
    "METADATA",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "async_save",
    "check_against",
    "load",
    "read_entries",
    "read_metadata",
    "save",
]

METADATA = ".metadata"

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")  # _local: Python >= 3.13
        for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else.

    An unpickler calls only what find_class hands it; limiting that to inert
    data classes (and dtype/layout lookups) is the documented way to unpickle
    data that may not be trusted.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def read_metadata(ckpt: Path) -> Metadata:
    """The DCP metadata of `ckpt`, built by the restricted unpickler."""
    path = Path(ckpt) / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects that are not DCP metadata and was refused without running "
            f"them ({exc}). The checkpoint was altered or not written by "
            "torch.distributed.checkpoint; do not load it unless you trust its author."
        ) from exc
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}): the sharded checkpoint is "
            f"damaged: {load_earlier()}."
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds {article(type(metadata).__name__)}, not DCP Metadata.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner (resharding into the given state dict), weights_only for values."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"the value {fqn!r} in the sharded checkpoint is not plain data and was "
                f"refused without running it ({str(exc).splitlines()[0]})."
            ) from exc
        # DefaultLoadPlanner puts the value where it belongs (nested state dicts
        # included); what it unpickles now is our own plain copy of it.
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)


_SINGLE_PROCESS = "torch.distributed is disabled"


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group that it assumes one
    # process; that is exactly the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def save(ckpt: Path, state_dict: dict[str, Any]) -> None:
    """Every rank writes its shards of `state_dict` into `ckpt` (collective)."""
    if not _distributed():
        _save_one_process(ckpt, state_dict)
        return
    dcp.save(state_dict, checkpoint_id=ckpt)


def _save_one_process(ckpt: Path, state_dict: dict[str, Any]) -> None:
    if threading.current_thread() is threading.main_thread():
        with _quiet_single_process():
            dcp.save(state_dict, storage_writer=FileSystemWriter(ckpt), no_dist=True)
        return
    # An async save's thread: catch_warnings is not thread-safe, so the warning that
    # one process is assumed (which it is) is filtered for the whole process.
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
    dcp.save(state_dict, storage_writer=FileSystemWriter(ckpt), no_dist=True)


def async_save(ckpt: Path, state_dict: dict[str, Any], process_group: Any) -> Callable[[], None]:
    """Copy `state_dict` to CPU memory now; return the call that finishes writing it.

    The returned function blocks until the checkpoint is written: run it in a
    background thread. `process_group` must be a CPU (Gloo) group of its own:
    DCP's background planning collectives must never interleave with the
    training loop's collectives on the default group.
    """
    if not _distributed():
        staged = _map_tensors(state_dict, lambda t: t.detach().to("cpu", copy=True))
        return lambda: _save_one_process(ckpt, staged)
    result = dcp.async_save(state_dict, checkpoint_id=ckpt, process_group=process_group)
    # With the default (synchronous) staging DCP returns a plain Future; the
    # response object (AsyncSaveResponse, torch >= 2.8) only appears with async
    # staging, which we do not ask for.
    future: Any = getattr(result, "upload_completion", result)

    def finish() -> None:
        future.result()

    return finish


def check_against(metadata: Metadata, state_dict: Mapping[str, Any]) -> list[str]:
    """What in `state_dict` (what we will load into) the checkpoint lacks or shapes otherwise."""
    flat = _flatten(state_dict)
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None:
            problems.append(f"{key} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                problems.append(f"{key} is a tensor here but not in the checkpoint")
            elif tuple(entry.size) != tuple(value.shape):
                problems.append(
                    f"{key}: checkpoint shape {tuple(entry.size)}, here {tuple(value.shape)}"
                )
        elif not isinstance(entry, BytesStorageMetadata):
            problems.append(f"{key} is a tensor in the checkpoint but a value here")
    return problems


def load(ckpt: Path, state_dict: dict[str, Any]) -> None:
    """Fill `state_dict` (DTensors, plain tensors, values) in place from `ckpt`; reshards."""
    with _quiet_single_process():
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(ckpt),
            planner=SafeLoadPlanner(),
            no_dist=not _distributed(),
        )


def read_entries(ckpt: Path, prefix: str) -> dict[str, Any]:
    """Whole tensors/values saved under `prefix` (e.g. "model"), in this process alone.

    Empty tensors of each entry's global shape and dtype (from the metadata) are given
    to dcp.load, which fills them from every rank's shards.
    """
    metadata = read_metadata(ckpt)
    start = prefix + "."
    entries = {k: m for k, m in metadata.state_dict_metadata.items() if k.startswith(start)}
    if not entries:
        raise CheckpointError(f"the sharded checkpoint {ckpt} holds no entries under {prefix!r}.")
    inner: dict[str, Any] = {
        key[len(start) :]: (
            torch.empty(tuple(m.size), dtype=m.properties.dtype)
            if isinstance(m, TensorStorageMetadata)
            else None
        )
        for key, m in entries.items()
    }
    target = {prefix: inner}
    load(ckpt, target)
    return target[prefix]


def _flatten(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as DCP stores them: one level of keys joined with dots."""
    flat: dict[str, Any] = {}
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj
