"""The longest sequence a model takes, and the data's samples checked against it before
the first step.

A model with a learned position table (GPT-2's `wpe`, the gpt recipe's `pos_emb`, BERT's
`position_embeddings`) looks up one row per position: a sample longer than the table
indexes past it, which the first forward raises as an IndexError deep inside
torch.embedding on every rank, and on a GPU as a device-side assert that leaves the CUDA
context unusable. Rotary or ALiBi positions have no table and take any length (a config's
max_position_embeddings is then what the model was trained at, not a limit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, spell

__all__ = ["MAX_SEQ_FIELDS", "check_sample_length", "longest_sequence", "position_table"]

MAX_SEQ_FIELDS = ("max_position_embeddings", "max_seq_len", "block_size", "n_positions")
"""Where a model's config states the longest sequence it takes (Hugging Face, LlamaShape,
the gpt recipe's GPTConfig, GPT-2's own name)."""


def longest_sequence(model: nn.Module) -> tuple[str, int] | None:
    """(where, tokens): the longest sequence the model's config states (`MAX_SEQ_FIELDS`,
    "config.n_positions"), else its position table's rows ("transformer.wpe"); None
    where neither says."""
    config = getattr(model, "config", None)
    for field in MAX_SEQ_FIELDS:
        if isinstance(most := getattr(config, field, None), int) and most > 0:
            return f"config.{field}", most
    return position_table(model)


def position_table(model: nn.Module) -> tuple[str, int] | None:
    """(name, rows) of the model's learned position table: an nn.Embedding named for
    positions (`wpe`, or a name holding "pos"), the shortest where there are several;
    None where it has none (rotary, ALiBi or no positions: any length runs)."""
    tables = [
        (name, m.num_embeddings)
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding)
        and (name.rpartition(".")[2] == "wpe" or "pos" in name.rpartition(".")[2].lower())
    ]
    return min(tables, key=lambda t: t[1]) if tables else None


def _tokens(sample: Any) -> int | None:
    """Tokens per sample of a dataset's (inputs, targets) sample: the length of its
    inputs where they are token ids (a 1-D integer tensor, or a mapping's input_ids);
    None for anything else."""
    inputs = sample[0] if isinstance(sample, (tuple, list)) and sample else None
    if isinstance(inputs, Mapping):
        inputs = inputs.get("input_ids")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 1:
        return None
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        return None
    return int(inputs.shape[0])


def check_sample_length(model: nn.Module, datasets: Mapping[str, Any], owner: str) -> None:
    """Refuse, before the first step, data whose samples are longer than the model's
    position table (module docstring): each dataset's first sample (`datasets`: split ->
    a map-style dataset; others are not read ahead). `owner`: the model as the user named
    it (`--model mm.py:build`). A sample that cannot be read here is left to the loader,
    which raises its error where it always does."""
    table = position_table(model)
    if table is None:
        return
    name, rows = table
    for split, data in datasets.items():
        try:
            tokens = _tokens(data[0]) if len(data) else None
        except Exception:  # an iterable dataset, or a sample that fails: the loader's
            continue
        if tokens is not None and tokens > rows:
            raise ConfigError(
                f"{owner}: its position table {name} has {rows} rows (one per position), "
                f"and the {split} data's samples are {tokens} tokens long: the first step "
                "would index past it (an IndexError, on a GPU a device-side assert). Fix: "
                f"samples of at most {rows} tokens ({spell('data')}, or the model module's "
                f"datasets), or a model with a position table of {tokens} rows or more.",
                field="data",
            )
