"""A Hugging Face `config.json` as a Recipe: `--model path/config.json` (or the directory
holding it) pretrains the causal language model the file describes, from random
initialisation.

The model is built through transformers from the file alone (no weights, no download)
in torch's default dtype, fp32 unless the caller set another, whatever dtype the file
states (the run's precision decides what a step computes in), with `use_cache=False`.
It trains on the gpt and llama recipes' bytes (Python's own sources, token ids below
256) at `CONFIG_BLOCK` tokens per sample, or the model's
max_position_embeddings where that is less, with torchtitan's AdamW; `--data MODULE:NAME`
gives it other data (see `scaletrain.train.model_module.load_recipe`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from scaletrain._lazy import import_quietly
from scaletrain.errors import ConfigError, closest, spell
from scaletrain.train.model_module import _safe_name
from scaletrain.train.recipes import Recipe, _python_text, _python_text_locate, _tokens

__all__ = ["CONFIG_BLOCK", "config_file", "config_recipe"]

CONFIG_BLOCK = 64
"""Tokens per training sample of a config.json model (the gpt and llama recipes'), or its
max_position_embeddings where that is less."""

_BYTES = 256
"""Token ids of the byte-level corpus: 0..255."""


def config_file(spec: str, *, field: str = "model") -> Path | None:
    """The config.json `spec` names (a .json path, or a directory holding config.json that
    is no Python package), None for a model module. Raises ConfigError, in the words of
    the setting `field`, when that file is not there."""
    path = Path(spec)
    if path.is_dir() and not (path / "__init__.py").is_file():
        path = path / "config.json"
    elif not spec.endswith(".json"):
        return None
    if not path.is_file():
        raise ConfigError(
            f"{spell(field, spec)}: no file {path}. Fix: the path of a Hugging Face "
            "config.json (or the directory holding it), or a model module (MODULE:NAME).",
            field=field,
        )
    return path


def _from_config(lm: Any, config: Any) -> torch.nn.Module:
    """The model in torch's default dtype (fp32 unless the caller set another) whatever
    dtype the file states: the run's precision decides, and a plan's profile builds a
    step's weights in the dtype it reads them in under that default."""
    return lm._from_config(config, dtype=torch.get_default_dtype())


def config_recipe(spec: str, path: Path, *, field: str = "model") -> Recipe:
    """The Recipe of the config.json at `path` (`spec` as the user gave it: the run
    records it, so a resume, a fork or `plan --check` rebuilds the same model). Raises
    ConfigError, in the words of `field`, for a file transformers cannot build a causal
    language model from. Nothing is built here."""
    lm, config = _causal_lm(spec, path, field)
    vocab = int(config.get_text_config().vocab_size)
    most = getattr(config, "max_position_embeddings", None)
    block = min(CONFIG_BLOCK, most) if isinstance(most, int) and most > 0 else CONFIG_BLOCK
    return Recipe(
        name=_safe_name(path.resolve().parent.name),
        spec=spec,
        dataset="python sources (byte-level)",
        build=partial(_from_config, lm, config),
        data=partial(_python_text, block_size=block),
        locate_data=partial(_byte_corpus, vocab, spec, field),
        example=partial(_tokens, vocab=vocab, seq=block),
        lr=3e-4,
        optimizer_name="adamw",
        betas=(0.9, 0.95),
        weight_decay=0.1,
        reference_batch=None,
        epochs=1,
        warmup=100,
        batch_size=8,
        eval_batch_size=8,
        task="language-model",
        token_loss=True,
    )


def _causal_lm(spec: str, path: Path, field: str) -> tuple[Any, Any]:
    """(the transformers causal-LM class, its config) that the file at `path` describes."""
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{spell(field, spec)}: {path} is not JSON ({exc}). Fix: the config.json of a "
            "Hugging Face model.",
            field=field,
        ) from None
    settings = settings if isinstance(settings, dict) else {}
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError:
        raise ConfigError(
            f"{spell(field, spec)} is a Hugging Face config, which is built through "
            "transformers, and it is not installed. Fix: pip install transformers.",
            field=field,
        ) from None
    # Its models' module imports torchao where it is installed (its quantizers): outside
    # the refusal above, so a torchao that fails to import says so itself.
    import_quietly("transformers.modeling_utils")
    archs = [a for a in settings.get("architectures") or [] if isinstance(a, str)]
    known = [getattr(transformers, a, None) for a in archs]
    model_type = settings.pop("model_type", None)
    if model_type is None and known and known[0] is not None:
        model_type = getattr(getattr(known[0], "config_class", None), "model_type", None)
    if model_type not in CONFIG_MAPPING:
        near = closest(model_type, list(CONFIG_MAPPING.keys())) if model_type else []
        said = f"its model_type is {model_type!r}" if model_type else "it names no model_type"
        raise ConfigError(
            f"{spell(field, spec)}: {said} and its architectures are {archs or 'none'}, "
            f"which transformers {transformers.__version__} does not know"
            + (f" (did it mean {' or '.join(near)}?)" if near else "")
            + ". Fix: a config.json whose model_type transformers knows (upgrading "
            "transformers adds newer ones), or a model module (MODULE:NAME).",
            field=field,
        )
    settings["use_cache"] = False  # training keeps no key-value cache
    try:
        config = CONFIG_MAPPING[model_type](**settings)
    except Exception as exc:  # its validators raise their own kinds
        said = " ".join(str(exc).split()).rstrip(".")
        raise ConfigError(
            f"{spell(field, spec)}: transformers refused {path}: {said}. Fix: that setting "
            "in the file.",
            field=field,
        ) from None
    named = known[0] if archs and archs[0].endswith(("ForCausalLM", "LMHeadModel")) else None
    lm: Any = named or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if lm is None:
        raise ConfigError(
            f"{spell(field, spec)}: transformers builds no causal language model for "
            f"model_type {model_type!r}, which is what scaletrain builds from a config.json. "
            "Fix: plan it as a model module (MODULE:NAME) and train it as one: a factory "
            "that builds it, with its own datasets() and loss().",
            field=field,
        )
    return lm, config


def _byte_corpus(vocab: int, spec: str, field: str, data_dir: str | None) -> str | None:
    """The corpus's directory, once the model's vocabulary is known to hold its bytes
    (before any process starts: a token id past the embedding fails on some rank, later)."""
    if vocab < _BYTES:
        raise ConfigError(
            f"{spell(field, spec)}: its vocab_size is {vocab}, and the data it trains on by "
            f"default is bytes (token ids 0 to {_BYTES - 1}). Fix: a vocab_size of {_BYTES} "
            f"or more in the file, or data of your own: {spell('data', 'MODULE:NAME')}.",
            field=field,
        )
    return _python_text_locate(data_dir)
