"""A Hugging Face Llama, trained by `scaletrain train --model examples/hf_llama.py:build`.

The model is built from a `LlamaConfig` (RMSNorm, rotary embeddings, SwiGLU, grouped-
query attention), so nothing is downloaded; it learns byte-level next-token prediction
on Python's own sources (scaletrain's text corpus). It is a plain model module (see
`scaletrain.train.recipes`): a factory, `datasets`, and a few settings. The loss and
the evaluation are scaletrain's defaults, which read the `logits` of the
`CausalLMOutputWithPast` the model returns.

    scaletrain train --model examples/hf_llama.py:build --max-steps 50
    scaletrain train --model examples/hf_llama.py:build --strategy fsdp --max-steps 50
    scaletrain train --model examples/hf_llama.py:build --strategy tensor --max-steps 50
    scaletrain train --model examples/hf_llama.py:build --mesh dp=2,tp=2 --strategy fsdp

`build_1b` is the same architecture at about a billion parameters (for one GPU and
plans); `HF_LLAMA_BLOCK` sets the sequence length (default 64 tokens).
"""

from __future__ import annotations

import os

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from scaletrain.data.text import load_python_corpus

BLOCK = int(os.environ.get("HF_LLAMA_BLOCK", "64"))
"""Tokens per sample."""

task = "language-model"
lr = 1e-3
batch_size = 8
eval_batch_size = 16
warmup = 10


def config(**sizes: int) -> LlamaConfig:
    """A small Llama over 256 byte tokens; `sizes` override its widths and depths."""
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **sizes,
    }
    return LlamaConfig(
        vocab_size=256,
        max_position_embeddings=max(BLOCK, 128),
        tie_word_embeddings=False,
        use_cache=False,  # training needs no key-value cache (and torch.export traces it)
        **shape,
    )


def build() -> nn.Module:
    return LlamaForCausalLM(config())


def build_1b() -> nn.Module:
    """About 1.1B parameters: 16 layers of width 2048, 32 heads (8 of keys and values)."""
    return LlamaForCausalLM(
        config(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    )


def datasets(split: str, data_dir: str | None = None) -> object:
    return load_python_corpus(split, block_size=BLOCK, root=data_dir)
