"""The models people plan: a recipe, a model module, or a Hugging Face `config.json`.

`resolve_model` turns each into a `PlannedModel` through its Recipe (`load_recipe`:
a `config.json` is the causal language model it describes, built through transformers
from the file alone, in torch's default dtype: the layout's precision decides what a
step computes in).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain._lazy import on_meta
from scaletrain.errors import ConfigError, article, spell
from scaletrain.strategies.blocks import auto_wrap_targets
from scaletrain.strategies.tensor_plan import declared_tp_plan, default_tp_plan
from scaletrain.train.positions import longest_sequence

__all__ = ["HF_SEQ_LEN", "PlannedModel", "resolve_model"]

HF_SEQ_LEN = 4096
"""Tokens per sample of a `config.json` model where none is given (or its maximum,
max_position_embeddings, where that is less)."""


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
    """How TensorParallel would cut it (`_tp_plan`); None where it cannot."""
    blocks: tuple[str, ...]
    """Qualified names of the repeated blocks (what FSDP wraps and checkpointing acts on)."""
    net: nn.Module
    """The model as `build` makes it, on the meta device (sizes, names, no memory)."""
    no_tp: str = ""
    """Why TensorParallel cannot cut it where it declares a plan (`_tp_plan`)."""
    key: tuple[str, ...] | None = None
    """What a profile of it depends on, where its code is fixed within a process (a
    recipe's, or transformers' for a config.json: the recipe's name or the file's text,
    `_fingerprint`, the tokens per sample), so a profile of it can be reused; None for
    a model module, whose code its user may edit and reload."""


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
    for name, given in (("recipe", recipe), ("model", model)):
        if given is not None and not isinstance(given, str):
            raise ConfigError(
                f"{name} is {article(type(given).__name__)}: expected a name, e.g. "
                f"{spell('recipe', 'gpt')}, "
                f"{spell('model', 'mymodel.py:build')} or {spell('model', 'path/config.json')}. "
                "Fix: the module and factory that build the model, not the model itself.",
                field=name,
            )
    for field, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ConfigError(
                f"{spell(field, value)}: expected a positive whole number. Fix: "
                f"{spell(field, 1)} or more, or leave it out for the model's default.",
                field=field,
            )
    from scaletrain.train.hf_config import config_file
    from scaletrain.train.model_module import check_recipe, load_recipe
    from scaletrain.train.recipes import get_recipe

    spec = recipe is not None and (
        ":" in recipe or recipe.endswith((".json", ".py")) or "/" in recipe
    )  # a module's factory, a config.json, or the file or folder holding it
    if model is None and spec:
        raise ConfigError(
            f"{spell('recipe', recipe)} names a model module or config.json, not one of "
            f"scaletrain's recipes. Fix: {spell('model', recipe)}.",
            field="recipe",
        )
    if model is None:
        r = get_recipe(recipe or "convnet")
    else:
        r = load_recipe(model)
        check_recipe(r, training=False)
    name = r.spec or r.name
    source = f"recipe {r.name}" if model is None else None
    with on_meta():
        net = r.build()
    inputs, _ = r.example(1)
    seq = isinstance(inputs, torch.Tensor) and inputs.dtype == torch.int64 and inputs.dim() == 2
    if seq_len is not None and not seq:
        shown = article(type(inputs).__name__)
        if isinstance(inputs, torch.Tensor):
            shown = f"{str(inputs.dtype).removeprefix('torch.')} of shape {tuple(inputs.shape)}"
        raise ConfigError(
            f"{spell('seq_len', seq_len)} only applies to sequence models (inputs of "
            f"token ids shaped (batch, tokens)); {name}'s inputs are {shown}. Fix: leave "
            f"out {spell('seq_len')}.",
            field="seq_len",
        )
    default, per_replica = (int(inputs.shape[1]) if seq else 0), r.batch_size
    if model is not None and (hf := config_file(model)) is not None:
        # A config.json is planned as such models are trained at scale: one sequence per
        # replica, as long as the model takes (HF_SEQ_LEN at most), not at its recipe's
        # short default.
        name = f"{type(net).__name__} ({hf})"
        source = f"config.json {hf.read_text(encoding='utf-8', errors='replace')}"
        most = getattr(getattr(net, "config", None), "max_position_embeddings", None)
        default, per_replica = min(HF_SEQ_LEN, most or HF_SEQ_LEN), 1
    tokens = _tokens_of(name, net, seq_len, default) if seq else None
    example = r.example
    if tokens is not None and (seq_len is not None or tokens != int(inputs.shape[1])):
        # A model module's own example(batch_size, seq_len=...), which its recipe wraps.
        own = next(iter(r.example.args), None) if isinstance(r.example, partial) else None
        example = _with_seq(name, own if callable(own) else r.example, tokens)
    blocks = auto_wrap_targets(net)
    if not blocks:  # a Hugging Face model names its blocks' classes
        kinds = set(getattr(net, "_no_split_modules", None) or ())
        blocks = [n for n, m in net.named_modules() if type(m).__name__ in kinds]
    tp_plan, no_tp = _tp_plan(net)
    return PlannedModel(
        name=name, build=r.build, example=example, loss=r.loss,
        optimizer=partial(r.optimizer, lr=r.lr), batch_size=batch_size or per_replica,
        seq_len=tokens, tp_plan=tp_plan, blocks=tuple(blocks), net=net, no_tp=no_tp,
        key=None if source is None else (source, _fingerprint(net, blocks), str(tokens)),
    )  # fmt: skip


def _fingerprint(net: nn.Module, blocks: Iterable[str]) -> str:
    """What a profile of a model whose code is fixed (a recipe's, transformers') depends
    on beyond that code: its modules, their config, its parameters' and buffers' shapes,
    dtypes and training, and its blocks (what checkpointing acts on)."""
    text = [repr(net), repr(getattr(net, "config", None)), *blocks]
    text += (f"{n} {tuple(p.shape)} {p.dtype} {p.requires_grad}" for n, p in net.named_parameters())
    text += (f"{n} {tuple(b.shape)} {b.dtype}" for n, b in net.named_buffers())
    return hashlib.sha256("\n".join(text).encode()).hexdigest()


def _tokens_of(name: str, net: nn.Module, seq_len: int | None, default: int) -> int:
    """Tokens per sample: `seq_len`, refused beyond the longest sequence the model's
    config states or its position table holds (`longest_sequence`), else `default`."""
    if seq_len is not None and (most := longest_sequence(net)) and seq_len > most[1]:
        where, tokens = most
        raise ConfigError(
            f"{spell('seq_len', seq_len)} is more than {name} takes: its "
            + (f"{where} is {tokens}" if where.startswith("config.")
               else f"position table {where} holds {tokens} positions")
            + f". Fix: {spell('seq_len', tokens)} or less.",
            field="seq_len",
        )  # fmt: skip
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


def _tp_plan(net: nn.Module) -> tuple[dict[str, str] | None, str]:
    """TensorParallel's plan without a user's (the declared one, else the default), and
    why there is none where the model declares one TensorParallel refuses (a mixture of
    experts' styles): training refuses it too."""
    try:
        declared = declared_tp_plan(net)
    except ConfigError as exc:
        return None, str(exc).partition(" Fix:")[0].rstrip(".")
    try:
        return declared or default_tp_plan(net), ""
    except ConfigError:
        return None, ""
