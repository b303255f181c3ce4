"""The models the recipes train: the seeds' nets, a small GPT for the parallelisms, and
a Llama-shaped transformer from a debug size to Llama 3.1 8B (scaletrain.train.llama,
re-exported here).

Plain nn.Modules with no knowledge of scaletrain: every strategy must handle them
unchanged, which is the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.train.llama import (
    LLAMA_SHAPES,
    LLAMA_TP_PLAN,
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaShape,
    SwiGLU,
    apply_rope,
    rope_tables,
)

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
