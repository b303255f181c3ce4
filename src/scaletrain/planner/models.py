"""The models people plan: a recipe, a model module, or a Hugging Face `config.json`.

`resolve_model` turns each into a `PlannedModel`. A `config.json` is built through
transformers from the file alone (no weights, no download) as the causal language
model it describes, in fp32 (the layout's precision decides what a step computes in).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, closest, spell
from scaletrain.strategies.blocks import auto_wrap_targets
from scaletrain.strategies.tensor_plan import declared_tp_plan, default_tp_plan
from scaletrain.train.loop import logits_of

__all__ = ["HF_SEQ_LEN", "PlannedModel", "resolve_model"]

HF_SEQ_LEN = 4096
"""Tokens per sample of a `config.json` model where none is given (or its maximum,
max_position_embeddings, where that is less)."""

_MAX_SEQ_FIELDS = ("max_position_embeddings", "max_seq_len", "block_size", "n_positions")
"""Where a model's config states the longest sequence it takes (Hugging Face,
LlamaShape, GPTConfig, GPT-2's own name)."""


@dataclass(frozen=True, slots=True)
class PlannedModel:
    """A model as the planner sees it (see `resolve_model`)."""

    name: str
    """"llama-8b", "examples.mymodel:build", "Qwen2ForCausalLM (path/config.json)"."""
    build: Callable[[], nn.Module]
    """Builds the model; called under `with torch.device("meta")`."""
    example: Callable[[int], tuple[Any, Any]]
    """batch size -> (inputs, targets): small CPU tensors of the right shape and dtype."""
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch_size: int
    """Samples per replica per step, by default."""
    seq_len: int | None
    """Tokens per sample of a sequence model; None for others."""
    tp_plan: dict[str, str] | None
    """How TensorParallel would cut it (`_tp_plan`); None where it has nothing to cut."""
    blocks: tuple[str, ...]
    """Qualified names of the repeated blocks (what FSDP wraps and checkpointing acts on)."""


def resolve_model(
    recipe: str | None = None,
    model: str | None = None,
    *,
    seq_len: int | None = None,
    batch_size: int | None = None,
) -> PlannedModel:
    """The model `recipe` names (a scaletrain recipe, "convnet" when neither is given) or
    `model` names ("module:factory", a .py path, or a Hugging Face config.json or the
    directory holding it). `seq_len` sets the tokens per sample of a sequence model,
    `batch_size` the samples per replica. Raises ConfigError, in the caller's words,
    for anything that cannot be planned."""
    if recipe is not None and model is not None:
        raise ConfigError(
            f"{spell('recipe', recipe)} and {spell('model', model)} both name the model. "
            "Fix: give one of them.",
            field="model",
        )
    for field, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise ConfigError(
                f"{spell(field, value)}: expected a positive whole number. Fix: "
                f"{spell(field, 1)} or more, or leave it out for the model's default.",
                field=field,
            )
    if model is not None and (config := _config_file(model)) is not None:
        return _hugging_face(model, config, seq_len, batch_size)
    from scaletrain.train.recipes import check_recipe, get_recipe, load_recipe

    if model is None:
        r = get_recipe(recipe or "convnet")
    else:
        r = load_recipe(model)
        check_recipe(r, training=False)
    name = r.spec or r.name
    with torch.device("meta"):
        net = r.build()
    inputs, _ = r.example(1)
    seq = isinstance(inputs, torch.Tensor) and inputs.dtype == torch.int64 and inputs.dim() == 2
    if seq_len is not None and not seq:
        shown = f"a {type(inputs).__name__}"
        if isinstance(inputs, torch.Tensor):
            shown = f"{str(inputs.dtype).removeprefix('torch.')} of shape {tuple(inputs.shape)}"
        raise ConfigError(
            f"{spell('seq_len', seq_len)} only applies to sequence models (inputs of "
            f"token ids shaped (batch, tokens)); {name}'s inputs are {shown}. Fix: leave "
            f"out {spell('seq_len')}.",
            field="seq_len",
        )
    tokens = _tokens_of(name, net, seq_len, int(inputs.shape[1])) if seq else None
    example = r.example
    if seq_len is not None:
        # A model module's own example(batch_size, seq_len=...), which its recipe wraps.
        own = r.example.args[0] if r.spec and isinstance(r.example, partial) else None
        example = _with_seq(name, own if callable(own) else r.example, seq_len)
    return PlannedModel(
        name=name,
        build=r.build,
        example=example,
        loss=r.loss,
        optimizer=partial(r.optimizer, lr=r.lr),
        batch_size=batch_size or r.batch_size,
        seq_len=tokens,
        tp_plan=_tp_plan(net),
        blocks=tuple(auto_wrap_targets(net)),
    )


def _tokens_of(name: str, net: nn.Module, seq_len: int | None, default: int) -> int:
    """Tokens per sample: `seq_len`, refused beyond the longest sequence the model's
    config states, else `default`."""
    config = getattr(net, "config", None)
    found = ((f, getattr(config, f, None)) for f in _MAX_SEQ_FIELDS)
    field, most = next(((f, v) for f, v in found if isinstance(v, int) and v > 0), ("", None))
    if seq_len is not None and most is not None and seq_len > most:
        raise ConfigError(
            f"{spell('seq_len', seq_len)} is more than {name} takes: its config.{field} is "
            f"{most}. Fix: {spell('seq_len', most)} or less.",
            field="seq_len",
        )
    return seq_len or default


def _with_seq(name: str, example: Callable[..., Any], seq_len: int) -> Callable[[int], Any]:
    """The example at `seq_len` tokens: through its seq_len (a model module's) or seq (a
    recipe's) parameter."""
    params = inspect.signature(example).parameters
    for keyword in ("seq_len", "seq"):
        if keyword in params:
            return partial(example, **{keyword: seq_len})
    raise ConfigError(
        f"{spell('seq_len', seq_len)}: {name}'s example(batch_size) takes no sequence "
        "length. Fix: give it one (def example(batch_size, seq_len=...) returning inputs of "
        f"shape (batch_size, seq_len)), or leave out {spell('seq_len')}.",
        field="seq_len",
    )


def _tp_plan(net: nn.Module) -> dict[str, str] | None:
    """TensorParallel's plan without a user's: the declared one, else the default."""
    try:
        return declared_tp_plan(net) or default_tp_plan(net)
    except ConfigError:
        return None


def _config_file(model: str) -> Path | None:
    """The config.json `model` names (a .json path or a directory holding config.json),
    None for a model module."""
    path = Path(model)
    if path.is_dir() and not (path / "__init__.py").is_file():
        path = path / "config.json"
    elif not model.endswith(".json"):
        return None
    if not path.is_file():
        raise ConfigError(
            f"{spell('model', model)}: no file {path}. Fix: the path of a Hugging Face "
            "config.json (or the directory holding it), or a model module (MODULE:NAME).",
            field="model",
        )
    return path


def _hugging_face(
    given: str, path: Path, seq_len: int | None, batch_size: int | None
) -> PlannedModel:
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{spell('model', given)}: {path} is not JSON ({exc}). Fix: the config.json of a "
            "Hugging Face model.",
            field="model",
        ) from None
    settings = settings if isinstance(settings, dict) else {}
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError:
        raise ConfigError(
            f"{spell('model', given)} is a Hugging Face config, which is built through "
            "transformers, and it is not installed. Fix: pip install transformers.",
            field="model",
        ) from None
    archs = [a for a in settings.get("architectures") or [] if isinstance(a, str)]
    known = [getattr(transformers, a, None) for a in archs]
    model_type = settings.pop("model_type", None)
    if model_type is None and known and known[0] is not None:
        model_type = getattr(getattr(known[0], "config_class", None), "model_type", None)
    if model_type not in CONFIG_MAPPING:
        near = closest(model_type, list(CONFIG_MAPPING.keys())) if model_type else []
        said = f"its model_type is {model_type!r}" if model_type else "it names no model_type"
        raise ConfigError(
            f"{spell('model', given)}: {said} and its architectures are {archs or 'none'}, "
            f"which transformers {transformers.__version__} does not know"
            + (f" (did it mean {' or '.join(near)}?)" if near else "")
            + ". Fix: a config.json whose model_type transformers knows (upgrading "
            "transformers adds newer ones), or a model module (MODULE:NAME).",
            field="model",
        )
    settings["use_cache"] = False
    try:
        config = CONFIG_MAPPING[model_type](**settings)
    except Exception as exc:  # its validators raise their own kinds
        said = " ".join(str(exc).split()).rstrip(".")
        raise ConfigError(
            f"{spell('model', given)}: transformers refused {path}: {said}. Fix: that setting "
            "in the file.",
            field="model",
        ) from None
    named = known[0] if archs and archs[0].endswith(("ForCausalLM", "LMHeadModel")) else None
    lm: Any = named or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if lm is None:
        raise ConfigError(
            f"{spell('model', given)}: transformers builds no causal language model for "
            f"model_type {model_type!r}, which is what a config.json is planned as. Fix: "
            "plan it as a model module (MODULE:NAME) with its own example and loss.",
            field="model",
        )
    # fp32 whatever dtype the file states: the layout's precision decides.
    build = partial(lm._from_config, config, dtype=torch.float32)
    with torch.device("meta"):
        net = build()
    name = f"{type(net).__name__} ({path})"
    most = getattr(config, "max_position_embeddings", None) or HF_SEQ_LEN
    tokens = _tokens_of(name, net, seq_len, min(HF_SEQ_LEN, most))
    vocab = int(config.get_text_config().vocab_size)
    blocks = auto_wrap_targets(net)
    if not blocks:
        kinds = set(getattr(net, "_no_split_modules", None) or ())
        blocks = [n for n, m in net.named_modules() if type(m).__name__ in kinds]
    return PlannedModel(
        name=name,
        build=build,
        example=partial(_tokens, vocab=vocab, seq_len=tokens),
        loss=_next_token_loss,
        optimizer=partial(torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
        batch_size=batch_size or 1,
        seq_len=tokens,
        tp_plan=_tp_plan(net),
        blocks=tuple(blocks),
    )


def _tokens(batch: int, *, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids; the targets are each position's next token."""
    tokens = torch.randint(0, vocab, (batch, seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = logits_of(outputs)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
    )
