"""The models the recipes train: the seeds' nets, a small GPT for the parallelisms, and
a Llama-shaped transformer from a debug size to Llama 3.1 8B.

Plain nn.Modules with no knowledge of scaletrain: every strategy must handle them
unchanged, which is the point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

__all__ = [
    "GPT",
    "LLAMA_SHAPES",
    "LLAMA_TP_PLAN",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "ConvNet",
    "GPTConfig",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaShape",
    "SplitNet",
    "SwiGLU",
    "WideResNet",
    "apply_rope",
    "rope_tables",
]


class ConvNet(nn.Module):
    """The seeds' MNIST ConvNet: conv5x5-16 BN ReLU pool, conv5x5-32 BN ReLU pool, linear."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        side = image_size // 4
        self.fc = nn.Linear(side * side * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        return self.fc(out)


class SplitNet(nn.Module):
    """The seeds' model-parallel `Net`: two linear layers meant for two devices.

    The seeds hard-code `.to("cuda:0")` / `.to("cuda:1")` inside the model; here the
    placement is the strategy's job (a device map naming `sub_net1` / `sub_net2`).
    """

    def __init__(self, in_features: int = 10, hidden: int = 10, out_features: int = 5) -> None:
        super().__init__()
        self.sub_net1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.sub_net2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub_net2(self.relu(self.sub_net1(x)))


class _WideBlock(nn.Module):
    """Pre-activation residual block: BN ReLU conv3x3, BN ReLU conv3x3 (+ 1x1 shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.shortcut = (
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        return out + skip


class WideResNet(nn.Module):
    """WRN-depth-k (Zagoruyko & Komodakis), the seeds' second example, sized for CPUs.

    depth = 6n + 4; three groups of n blocks with 16k, 32k, 64k channels. The
    default WRN-10-2 trains on Fashion-MNIST on a CPU in minutes.
    """

    def __init__(
        self, num_classes: int = 10, depth: int = 10, width: int = 2, in_channels: int = 1
    ) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"depth={depth} must be 6n + 4 (10, 16, 22, 28, ...)")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        groups = []
        cin = widths[0]
        for i, cout in enumerate(widths[1:]):
            blocks = [
                _WideBlock(cin if j == 0 else cout, cout, 1 if i == 0 else 2) for j in range(n)
            ]
            groups.append(nn.Sequential(*blocks))
            cin = cout
        self.groups = nn.Sequential(*groups)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.groups(self.conv(x))
        out = torch.relu(self.bn(out))
        out = nn.functional.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


@dataclass(kw_only=True, frozen=True, slots=True)
class GPTConfig:
    """Size of a GPT-style character language model."""

    vocab_size: int = 256
    """Tokens: bytes, so any text file is a corpus."""
    block_size: int = 64
    """Context length in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (a multiple of the tensor-parallel degree)."""
    n_embd: int = 128
    """Embedding width."""
    dropout: float = 0.0
    """Dropout rate; 0 keeps runs bitwise reproducible across strategies."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate q/k/v projections.

    The head count is read from the projection's *local* width, so when tensor
    parallel shards q/k/v column-wise each rank simply runs its share of the heads.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallel
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, heads * self.head_dim)
        return self.out_proj(y)


class MLP(nn.Module):
    """Feed-forward: fc (widen 4x), GELU, proj (back)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, blocks, final norm, LM head.

    Input: token ids (B, T) int64; output: logits (B, T, vocab_size).
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps early training stable.
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- Llama ---------------------------------------------------------------------------

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
