"""The longest sequence a model takes, and each start's first batch checked against it
before its first step.

A model with a learned position table (GPT-2's `wpe`, the gpt recipe's `pos_emb`, BERT's
`position_embeddings`) looks up one row per position: a sample longer than the table
indexes past it, which the first forward raises as an IndexError deep inside
torch.embedding on every rank, and on a GPU as a device-side assert that leaves the CUDA
context unusable. Rotary or ALiBi positions have no table and take any length (a config's
max_position_embeddings is then what the model was trained at, not a limit).

Only a table that is surely the model's positions counts: the one embedding of the
model named as one (`TABLE_NAMES`, a whole name: not `pos_tag_emb`, `rel_pos_bias`),
of as many rows as the model's config states where it states a longest sequence. A
model of several (CLIP's text and vision towers, an encoder-decoder's two) or whose
config says otherwise is not checked: its step says what it says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, spell

__all__ = ["MAX_SEQ_FIELDS", "TABLE_NAMES", "check_batch_length", "longest_sequence",
           "position_table"]  # fmt: skip

MAX_SEQ_FIELDS = ("max_position_embeddings", "max_seq_len", "block_size", "n_positions")
"""Where a model's config states the longest sequence it takes (Hugging Face, LlamaShape,
the gpt recipe's GPTConfig, GPT-2's own name)."""
TABLE_NAMES = ("wpe", "pos_emb", "pos_embedding", "position_embedding", "position_embeddings",
               "embed_positions")  # fmt: skip
"""The names of learned position tables (GPT-2 and GPT-Neo, the gpt recipe, ViT-style
models, BERT-style models, OPT-style models)."""


def _stated(model: nn.Module) -> tuple[str, int] | None:
    """("config.n_positions", 1024): the longest sequence the model's own config states."""
    config = getattr(model, "config", None)
    for field in MAX_SEQ_FIELDS:
        if isinstance(most := getattr(config, field, None), int) and most > 0:
            return f"config.{field}", most
    return None


def longest_sequence(model: nn.Module) -> tuple[str, int] | None:
    """(where, tokens): the longest sequence the model's config states (`MAX_SEQ_FIELDS`),
    else its position table's rows ("transformer.wpe"); None where neither says."""
    return _stated(model) or position_table(model)


def position_table(model: nn.Module) -> tuple[str, int] | None:
    """(name, rows) of the model's learned position table (module docstring: the one
    nn.Embedding named as one, of the rows its config states where it states any); None
    where there is none or it is not sure."""
    tables = [
        (name, m.num_embeddings)
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and name.rpartition(".")[2] in TABLE_NAMES
    ]
    if len(tables) != 1:
        return None
    stated = _stated(model)
    return tables[0] if stated is None or stated[1] == tables[0][1] else None


def check_batch_length(table: tuple[str, int] | None, batch: Any, owner: str) -> None:
    """Refuse a batch of token ids longer than the position `table` (`position_table`)
    before the model sees it; `owner`: the model as the user named it (`--model
    mm.py:build`). Inputs given with their own position_ids (packed sequences that
    restart their positions) are left to the model."""
    if table is None or not isinstance(batch, (tuple, list)) or not batch:
        return
    inputs = batch[0]
    if isinstance(inputs, Mapping):
        if "position_ids" in inputs:
            return
        inputs = inputs.get("input_ids")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        return
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        return
    name, rows = table
    if (tokens := int(inputs.shape[1])) > rows:
        raise ConfigError(
            f"{owner}: its position table {name} has {rows} rows (one per position), and the "
            f"data's samples are {tokens} tokens long: the first step would index past it "
            "(an IndexError, on a GPU a device-side assert). Fix: samples of at most "
            f"{rows} tokens ({spell('data')}, or the model module's datasets), or a model "
            f"with a position table of {tokens} rows or more.",
            field="data",
        )
