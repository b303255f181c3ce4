"""`scaletrain checkpoint export RUN DIR`: a run's model as a Hugging Face model directory.

The run's config.json names its model (`--model MODULE:NAME`); the factory builds it
again, the run's weights go in (model.pt of a finished run, else its newest valid
checkpoint, consolidated, whatever strategy wrote it), and transformers'
`save_pretrained` writes the directory: config.json and model.safetensors, which
`AutoModelForCausalLM.from_pretrained(DIR)` (or the model's own class) loads anywhere.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from scaletrain.errors import CheckpointError, ConfigError, article

__all__ = ["export_hf"]


def export_hf(run: str | Path, out: str | Path) -> tuple[Path, Path]:
    """Write the run's model to `out` as a Hugging Face directory; return (out, the
    file or checkpoint the weights came from). `out` must be new or empty: nothing
    already there is replaced."""
    from scaletrain.checkpoint import consolidate
    from scaletrain.checkpoint.catalog import explain_no_checkpoint, newest_valid
    from scaletrain.train.model_module import load_recipe

    run, out = Path(run), Path(out)
    config_file = run / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"{run} is not a run directory of scaletrain train: it has no config.json. "
            "Fix: the --out of a run."
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    spec = config.get("model")
    if not spec:
        raise ConfigError(
            f"the run in {run} trained the recipe {config.get('recipe')!r}, which is not a "
            "Hugging Face model: export writes a transformers model directory. Fix: "
            f"scaletrain checkpoint consolidate {run} model.pt for a plain state dict."
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out} already exists and is not an empty directory; export never writes over "
            "what is there. Fix: name a new directory."
        )
    recipe = load_recipe(spec, data=config.get("data"))
    model = recipe.build()
    if not _is_hugging_face(model):
        raise ConfigError(
            f"the run in {run} trained {spec}, {article(type(model).__name__)}, not a transformers "
            "PreTrainedModel: export writes a Hugging Face model directory. Fix: scaletrain "
            f"checkpoint consolidate {run} model.pt for a plain state dict."
        )
    source = run / "model.pt"
    if source.is_file():
        weights = torch.load(source, map_location="cpu", weights_only=True)
    else:
        found, _ = newest_valid(run)
        if found is None:
            raise CheckpointError(
                f"the run in {run} has no model.pt and no checkpoint to export: "
                f"{explain_no_checkpoint(run)}"
            )
        source = found
        with tempfile.TemporaryDirectory() as tmp:
            weights = torch.load(
                consolidate(found, Path(tmp) / "model.pt"), map_location="cpu", weights_only=True
            )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied weights (an LM head sharing the embedding) are one tensor saved under one name.
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not hold {spec}'s weights: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. Was the module changed since the run?"
        )
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line says what was written, not a bar
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    return out, source


def _is_hugging_face(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
