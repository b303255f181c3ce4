"""Recipes: the seeds' models with the data and optimiser settings that train them well."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, DatasetError, spell, unknown
from scaletrain.train.models import GPT, ConvNet, GPTConfig, SplitNet, WideResNet

__all__ = ["RECIPES", "Recipe", "get_recipe"]


def _fashion_mnist(data_dir: str | None, split: str) -> Any:
    from scaletrain.data import load_dataset

    return load_dataset("fashion-mnist", data_dir, split=split)


def _fashion_mnist_locate(data_dir: str | None) -> str | None:
    from scaletrain.data import find_dataset_dir

    return str(find_dataset_dir("fashion-mnist", data_dir))


def _teacher(data_dir: str | None, split: str) -> Any:
    from scaletrain.data.synthetic import teacher_dataset

    return teacher_dataset(split)


def _python_text(data_dir: str | None, split: str) -> Any:
    from scaletrain.data.text import load_python_corpus

    return load_python_corpus(split, block_size=_GPT.block_size, root=data_dir)


def _python_text_locate(data_dir: str | None) -> str | None:
    from scaletrain.data.text import python_corpus_root

    return str(python_corpus_root(data_dir))


def _generated(data_dir: str | None) -> str | None:
    if data_dir is not None:
        raise DatasetError(
            f"{spell('data_dir', data_dir)}: the split-net recipe generates its data (a fixed "
            f"random teacher network), so it reads no files. Fix: leave out "
            f"{spell('data_dir')}, or pick a recipe that reads files (convnet, wrn, gpt)."
        )
    return None


_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))


def _features(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 10), torch.randint(0, 5, (batch,))


def _tokens(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, _GPT.vocab_size, (batch, _GPT.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


@dataclass(kw_only=True, frozen=True, slots=True)
class Recipe:
    """A model, the data it trains on, and optimiser settings that work for it."""

    name: str
    """Name given to `scaletrain train --recipe`."""
    dataset: str
    """What the data is, for messages ("fashion-mnist", "python sources")."""
    build: Callable[[], nn.Module]
    """Builds the model (on CPU; the strategy places it)."""
    data: Callable[[str | None, str], Any]
    """(data_dir, split) -> Dataset of (input, target) pairs."""
    locate_data: Callable[[str | None], str | None] = _generated
    """(data_dir) -> the directory the data is read from (for the run header and
    config.json), None for data generated in memory; raises DatasetError before any
    process starts if it is not there."""
    example: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = _images
    """batch size -> random (inputs, targets) shaped like the data (for scaletrain plan)."""
    lr: float
    """Peak learning rate at `reference_batch`; scaled linearly with the global batch."""
    optimizer_name: str = "sgd"
    """"sgd" (Nesterov momentum) or "adamw"."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """Weight decay."""
    reference_batch: int = 200
    """Global batch size at which `lr` was tuned."""
    epochs: int = 2
    """Default passes over the data."""
    warmup: int = 100
    """Steps of linear learning-rate warm-up (a count, not a fraction: short runs too
    start gently)."""
    batch_size: int = 100
    """Default samples per rank per step."""
    eval_batch_size: int = 1000
    """Samples per rank per evaluation step."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm by default (the seeds' WideResNet example)."""
    task: str = "classification"
    """"classification" (accuracy) or "language-model" (next-token accuracy, loss)."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; sequence outputs (B, T, V) are flattened to tokens."""
        return nn.functional.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
        )

    def optimizer(self, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            params, lr=lr, momentum=self.momentum, nesterov=True, weight_decay=self.weight_decay
        )

    def scaled_lr(self, global_batch: int) -> float:
        """Linear scaling rule (Goyal et al.): the same recipe at another world size."""
        return self.lr * global_batch / self.reference_batch


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="convnet",
            dataset="fashion-mnist",
            build=ConvNet,
            data=_fashion_mnist,
            locate_data=_fashion_mnist_locate,
            lr=0.1,
        ),
        Recipe(
            name="split-net",
            dataset="teacher (synthetic, 10 features -> 5 classes)",
            build=SplitNet,
            data=_teacher,
            example=_features,
            lr=0.2,
            epochs=3,
            warmup=30,
            weight_decay=0.0,
        ),
        Recipe(
            name="wrn",
            dataset="fashion-mnist",
            build=partial(WideResNet, depth=10, width=1),
            data=_fashion_mnist,
            locate_data=_fashion_mnist_locate,
            lr=0.1,
            epochs=1,
            sync_bn=True,
            eval_batch_size=500,
        ),
        Recipe(
            name="gpt",
            dataset="python sources (byte-level)",
            build=partial(GPT, _GPT),
            data=_python_text,
            locate_data=_python_text_locate,
            example=_tokens,
            lr=1e-3,
            optimizer_name="adamw",
            weight_decay=0.01,
            reference_batch=64,
            epochs=1,
            batch_size=32,
            eval_batch_size=64,
            task="language-model",
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError(unknown("recipe", name, sorted(RECIPES)), field="recipe")
    return RECIPES[name]
