"""Checkpoints that resume bit-for-bit: full (atomic, checksummed) and sharded (DCP, async).

A training loop holds one CheckpointManager (interval, keep-K, async saving, resume):

from scaletrain.checkpoint import CheckpointManager

manager = CheckpointManager(rt, run_dir, every=100, keep=3)
resumed = manager.resume(model=model, optimizer=opt, loader=loader)
...
manager.maybe_save(step, model=model, optimizer=opt, loader=loader)
manager.close()

and the one-shot functions stay for scripts: save_checkpoint, load_checkpoint,
latest_checkpoint, consolidate (rt.save / rt.load call the first two).
"""

from scaletrain.checkpoint.asynchronous import AsyncSaver, PendingCheckpoint, wait_pending
from scaletrain.checkpoint.catalog import (
    Found,
    checkpoint_path,
    find_checkpoints,
    latest_checkpoint,
    list_checkpoints,
)
from scaletrain.checkpoint.convert import consolidate
from scaletrain.checkpoint.load import load_checkpoint, load_weights
from scaletrain.checkpoint.manager import CheckpointManager, Resumed
from scaletrain.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    RejectedCheckpointError,
    read_manifest,
)
from scaletrain.checkpoint.save import save_checkpoint
from scaletrain.checkpoint.scope import CheckpointScope

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "AsyncSaver",
    "CheckpointManager",
    "CheckpointScope",
    "Found",
    "Manifest",
    "PendingCheckpoint",
    "RejectedCheckpointError",
    "Resumed",
    "checkpoint_path",
    "consolidate",
    "find_checkpoints",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "read_manifest",
    "save_checkpoint",
    "wait_pending",
]
