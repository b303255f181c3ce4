"""Checkpoints that resume bit-for-bit: full (atomic, checksummed) and sharded (DCP, async).

from scaletrain.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint

ckpt = latest_checkpoint(run_dir)
if ckpt is not None:
    step = load_checkpoint(rt, ckpt, model=model, optimizer=opt, loader=loader)["step"]
...
save_checkpoint(rt, checkpoint_path(run_dir, step), keep=3,
                model=model, optimizer=opt, loader=loader, step=step)
"""

from scaletrain.checkpoint.api import (
    PendingCheckpoint,
    consolidate,
    load_checkpoint,
    save_checkpoint,
    wait_pending,
)
from scaletrain.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    checkpoint_path,
    latest_checkpoint,
    read_manifest,
)
from scaletrain.checkpoint.scope import CheckpointScope

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointScope",
    "Manifest",
    "PendingCheckpoint",
    "checkpoint_path",
    "consolidate",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "wait_pending",
]
