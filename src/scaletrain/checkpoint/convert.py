"""consolidate: one plain state dict from a full or sharded checkpoint, in one process."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from scaletrain.checkpoint import full as _full
from scaletrain.checkpoint.layout import dcp
from scaletrain.checkpoint.load import holdings
from scaletrain.checkpoint.manifest import (
    RejectedCheckpointError,
    load_earlier,
    read_manifest,
    verify_files,
)
from scaletrain.checkpoint.state import diff_tables, model_table
from scaletrain.errors import CheckpointError

__all__ = ["consolidate"]


def consolidate(
    checkpoint_dir: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> Path:
    """Write one plain state dict of a checkpoint's model, for `torch.load(weights_only=True)`.

    Works for full and sharded checkpoints, in one process, without a process
    group: sharded tensors are assembled whole. Keys carry no wrapper prefix
    (`module.`) and values are plain CPU tensors, so `bare_model.load_state_dict(
    torch.load(out_file, weights_only=True))` works. `model` names the model when
    the checkpoint holds several. Files are verified against the manifest first.
    """
    ckpt = Path(checkpoint_dir)
    manifest = read_manifest(ckpt)
    problems = verify_files(ckpt, manifest, manifest.files)
    if problems:
        raise RejectedCheckpointError(
            f"checkpoint {ckpt} is damaged: " + "; ".join(problems) + f"; {load_earlier()}.",
            reason="; ".join(problems),
        )
    models = [n for n, o in manifest.objects.items() if o.get("kind") == "model"]
    if model is None:
        if len(models) != 1:
            raise CheckpointError(
                f"checkpoint {ckpt} holds {len(models)} models ({', '.join(models) or 'none'}); "
                "name the one to consolidate with model=NAME."
            )
        model = models[0]
    if model not in models:
        raise CheckpointError(
            f"checkpoint {ckpt} has no model named {model!r}; it holds: {holdings(manifest)}."
        )
    if manifest.kind == "full":
        sd = _full.load_file(ckpt / f"{model}.pt")
    else:
        sd = dcp().read_entries(ckpt, model)
    sd = {
        k: (v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v)
        for k, v in sd.items()
    }
    table = manifest.objects[model].get("table", {})
    if set(sd) != set(table):
        raise CheckpointError(
            f"checkpoint {ckpt}: the entries of {model!r} do not match its manifest ("
            + "; ".join(diff_tables(table, model_table(sd)))
            + "). The checkpoint is damaged."
        )
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    _full.save_file(out, sd)
    return out
