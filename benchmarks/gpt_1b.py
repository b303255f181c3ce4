"""The gpt recipe's model scaled to ~1B parameters, for `scaletrain plan --model`:

    PYTHONPATH=benchmarks scaletrain plan --model gpt_1b:build --devices 64 \
        --hardware h100-sxm --batch-size 8 --precision bf16-mixed

20 blocks of width 2048 (12 x 20 x 2048^2 = 1.01B in the blocks), 16 heads, a context
of 1024 byte tokens (the recipe's vocabulary of 256).
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=1024, n_layer=20, n_head=16, n_embd=2048)
BATCH = 8
"""Sequences per replica in the benchmark's runs."""


def build() -> nn.Module:
    return GPT(CFG)


def example(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CFG.vocab_size, (batch, CFG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """As `scaletrain plan --model` trains a model: cross-entropy over the last dim."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
