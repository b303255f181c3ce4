"""A Llama-shaped transformer, from a debug size to Llama 3.1 8B (the llama recipes'
model): RMSNorm, rotary embeddings, SwiGLU and grouped-query attention, with its
tensor-parallel plan.

A plain nn.Module with no knowledge of scaletrain, like the recipes' other models
(scaletrain.train.models, which re-exports it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

__all__ = [
    "LLAMA_SHAPES",
    "LLAMA_TP_PLAN",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaShape",
    "SwiGLU",
    "apply_rope",
    "rope_tables",
]

LLAMA_TP_PLAN: dict[str, str] = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}
"""Llama's tensor-parallel plan (Megatron's, as torchtitan applies it to the blocks):
q/k/v and the SwiGLU's gate and up projections split by output columns, so each rank
holds whole query and key/value heads and its share of the hidden units; the output
projections split by input rows, one all-reduce per attention and per MLP. The
embeddings, norms and LM head stay replicated: a vocabulary-parallel head would hand
the loss sharded logits, which the recipes' cross-entropy does not take."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LlamaShape:
    """Size of a Llama-shaped model (Meta's reference implementation's ModelArgs)."""

    dim: int = 128
    """Embedding width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads per block (a multiple of the tensor-parallel degree)."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query
    heads); None: n_heads (multi-head attention). A multiple of the tensor-parallel degree."""
    vocab_size: int = 256
    """Tokens (256: bytes, so any text file is a corpus)."""
    multiple_of: int = 32
    """The SwiGLU's hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU's hidden width (before rounding); None: 1."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary embeddings' wavelengths."""
    rope_scaling: float | None = None
    """Llama 3.1's long-context frequency scaling factor (8 for 3.1, 32 for 3.2); None: off."""
    max_seq_len: int = 256
    """Longest sequence the model takes."""
    tie_embeddings: bool = False
    """The LM head shares the token embedding's matrix (Llama 3.2 1B and 3B)."""

    def __post_init__(self) -> None:
        kv = self.kv_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"the head width dim / n_heads = {self.dim // self.n_heads} must be even "
                "(rotary embeddings turn pairs of features)"
            )
        if kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(each key/value head serves the same number of query heads)"
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, else n_heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """The SwiGLU's hidden width, as Meta's reference computes it: 2/3 of 4 * dim
        (three matrices instead of two, the same parameters), scaled by
        ffn_dim_multiplier, rounded up to a multiple of multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The model's tensor-parallel plan (LLAMA_TP_PLAN), under the name a Hugging
        Face config gives it: TensorParallel reads a model's `config.base_model_tp_plan`
        (scaletrain.strategies.tensor_plan.declared_tp_plan)."""
        return dict(LLAMA_TP_PLAN)


LLAMA_SHAPES: dict[str, LlamaShape] = {
    # Trains in seconds on a CPU: the byte-level recipe's size.
    "debug": LlamaShape(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
        max_seq_len=256,
    ),
    # Llama 3.2 1B: 1,235,814,400 parameters.
    "1b": LlamaShape(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
        ffn_dim_multiplier=1.5, rope_theta=500000.0, rope_scaling=32.0, max_seq_len=131072,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B: 8,030,261,248 parameters.
    "8b": LlamaShape(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=8.0, max_seq_len=131072,
    ),
}  # fmt: skip
"""The named sizes of the llama recipes."""


def _truncated_normal_(weight: torch.Tensor, *, std: float, cutoff: float) -> None:
    """N(0, std^2) truncated to +-cutoff * std, by the inverse of the normal's CDF. No
    loop that depends on the values drawn (torch's own trunc_normal_ rejects and redraws
    in recent versions), so it runs on the meta device and under the planner's fake tensors,
    and a seed draws the same weights under every torch version."""
    edge = math.erf(cutoff / math.sqrt(2))
    weight.uniform_(-edge, edge).erfinv_().mul_(std * math.sqrt(2))


def _scaled_frequencies(freqs: torch.Tensor, factor: float) -> torch.Tensor:
    # Llama 3.1's rule (its reference's apply_scaling): wavelengths shorter than a
    # quarter of the 8,192-token original context keep their frequency, those longer
    # than the whole context are slowed by `factor`, and those between are blended.
    low_freq_factor, high_freq_factor, original = 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > original / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < original / high_freq_factor, freqs, out)


def rope_tables(
    shape: LlamaShape, seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim / 2) in float32: the rotary angles of
    positions 0..seq_len-1.

    Computed from the shape rather than kept as a buffer: nothing to save, nothing a
    checkpoint or a meta-device build must restore, and no precision conversion of the
    model (bf16-true) coarsens the angles of far positions."""
    half = shape.head_dim // 2
    exponents = torch.arange(0, half, device=device, dtype=torch.float32) * 2 / shape.head_dim
    freqs = 1.0 / (shape.rope_theta**exponents)
    if shape.rope_scaling is not None:
        freqs = _scaled_frequencies(freqs, shape.rope_scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of features (2i, 2i+1) of x (batch, seq, heads, head_dim) by its
    position's angle, as Meta's reference does with complex numbers; in float32, the
    result in x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary embeddings and no biases.

    The head counts are read from the projections' *local* widths, so when tensor
    parallel splits wq/wk/wv column-wise each rank runs its share of the query heads
    with the key/value heads that serve them.
    """

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.kv_heads, shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Under sequence parallel x is this rank's slice of the sequence and the
        # projections gather it: the sequence length is q's.
        b, t = q.shape[:2]
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = v.view(b, t, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        # Query head h uses key/value head h // (heads / kv_heads) (Meta's repeat_kv).
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's feed-forward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(RMSNorm(x)), then + SwiGLU(RMSNorm(.))."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.attention = LlamaAttention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.feed_forward = SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A Llama-shaped decoder: token embeddings, LlamaBlocks, RMSNorm, LM head.

    Input: token ids (B, T) int64, T <= max_seq_len; output: logits (B, T, vocab_size).
    Module names follow Meta's reference (tok_embeddings, layers.N.attention.wq, ...,
    norm, output). The blocks are `layers`, one nn.ModuleList of LlamaBlock: FSDP's
    units and the blocks other strategies act on. `config` is the LlamaShape; its
    `base_model_tp_plan` is the tensor-parallel plan (LLAMA_TP_PLAN).
    """

    def __init__(self, shape: LlamaShape | None = None) -> None:
        super().__init__()
        self.config = shape = shape or LLAMA_SHAPES["debug"]
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList([LlamaBlock(shape) for _ in range(shape.n_layers)])
        self.norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's initialisation, block by block in a fixed order (a seed gives
        the same weights on every rank and in every run): embeddings N(0, 1); q/k/v and
        w1 N(0, 0.02); each block's output projections (wo, w2, w3) at
        0.02 / sqrt(2 (layer + 1)), smaller with depth, so that the residual stream's
        variance grows slowly; the LM head N(0, 1/dim) truncated at 3 sigma, logits of
        unit scale. A tied head and embedding take the head's. (torchtitan truncates
        the block weights at +-2, 100 sigma or more: a plain normal, drawn as one.)"""
        shape = self.config
        if not shape.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(cast(Iterable[LlamaBlock], self.layers)):
            depth_std = 0.02 / (2 * (i + 1)) ** 0.5
            attn, ffn = layer.attention, layer.feed_forward
            for linear, std in (
                (attn.wq, 0.02), (attn.wk, 0.02), (attn.wv, 0.02), (attn.wo, depth_std),
                (ffn.w1, 0.02), (ffn.w2, depth_std), (ffn.w3, depth_std),
            ):  # fmt: skip
                nn.init.normal_(linear.weight, mean=0.0, std=std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        _truncated_normal_(self.output.weight, std=shape.dim**-0.5, cutoff=3.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"Llama got sequences of {t} tokens; this shape takes at most "
                f"max_seq_len={self.config.max_seq_len}."
            )
        cos, sin = rope_tables(self.config, t, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
