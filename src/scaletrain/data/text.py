"""A byte-level text corpus for the GPT recipe, read from files every machine has.

The corpus is the Python standard library's own sources: present wherever Python
is, no download, and real text (code, comments, docstrings) with structure a small
language model can learn.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from scaletrain.errors import ConfigError, DatasetError, spell

__all__ = ["TokenDataset", "load_python_corpus", "python_corpus_root", "read_corpus"]


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size` tokens: (x, y) with y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be >= 1.")
        if tokens.numel() < block_size + 1:
            raise DatasetError(
                f"the corpus has {tokens.numel()} tokens, fewer than one window of "
                f"block_size + 1 = {block_size + 1}. Give more text or a smaller block_size."
            )
        self.tokens = tokens.to(torch.int64)
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # One gather for the whole batch instead of a Python slice per window.
        starts = torch.as_tensor(indices, dtype=torch.int64) * self.block_size
        offsets = torch.arange(self.block_size + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]
        return list(zip(windows[:, :-1].unbind(0), windows[:, 1:].unbind(0), strict=True))


def read_corpus(files: Sequence[Path], max_bytes: int) -> torch.Tensor:
    """Concatenate files (sorted, so every rank and machine reads the same bytes)."""
    parts: list[bytes] = []
    total = 0
    for path in sorted(files):
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def _python_files(base: Path) -> Iterator[Path]:
    """Every .py file under `base` but those inside a site-packages directory (installed
    packages, not the library's sources). Such a directory is not walked at all: under
    the standard library it holds the interpreter's installed packages, which can be
    most of the tree."""
    if "site-packages" in base.parts:
        return
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (Path(folder, name) for name in files if name.endswith(".py"))


def python_corpus_root(root: str | Path | None = None) -> Path:
    """The directory the corpus is read from: `root`, else this Python's stdlib.

    Raises DatasetError when `root` does not exist or holds no .py file (at any depth).
    """
    base = Path(root).expanduser() if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise DatasetError(
            f"{spell('data_dir', str(base))}: no such directory. The gpt and llama recipes "
            "read Python sources (.py files, searched recursively) as their text corpus. Fix: "
            f"point {spell('data_dir')} at a directory of .py files, or leave it out to "
            "read this Python's standard library."
        )
    if next(_python_files(base), None) is None:
        raise DatasetError(
            f"no .py files under {base}: the gpt and llama recipes read Python sources as "
            f"their text corpus. Fix: point {spell('data_dir')} at a directory with .py "
            "files, or leave it out to read this Python's standard library."
        )
    return base


def load_python_corpus(
    split: str = "train",
    *,
    block_size: int = 64,
    max_bytes: int = 4_000_000,
    root: str | Path | None = None,
    test_fraction: float = 0.1,
) -> TokenDataset:
    """Byte tokens of the .py files under `root` (default: this Python's stdlib).

    Every k-th file (k = 1 / test_fraction) is a test file, the rest train: the
    splits never share a file, yet both sample the whole library (a split by
    position would test on other packages than it trains on).
    """
    if split not in ("train", "test"):
        raise ConfigError(f"split={split!r}: expected 'train' or 'test'.")
    base = python_corpus_root(root)
    files = list(_python_files(base))
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction={test_fraction} must be between 0 and 1.")
    every = max(2, round(1 / test_fraction))
    files = sorted(files)
    if split == "train":
        chosen = [p for i, p in enumerate(files) if i % every != every - 1]
        budget = int(max_bytes * (1 - test_fraction))
    else:
        chosen = [p for i, p in enumerate(files) if i % every == every - 1]
        budget = int(max_bytes * test_fraction)
    return TokenDataset(read_corpus(chosen, budget), block_size)
