"""The training loop behind `scaletrain train`, its config, and the seeds' recipes.

Names are imported on first use, so `scaletrain.train.config` (what the CLI reads
to build its flags) comes without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.train.config import TrainConfig
    from scaletrain.train.loop import (
        EvalResult,
        evaluate,
        seed_everything,
        sync_buffers,
        train_step,
    )
    from scaletrain.train.models import ConvNet
    from scaletrain.train.recipes import RECIPES, Recipe, get_recipe
    from scaletrain.train.trainer import Trainer

_WHERE = {
    "TrainConfig": "scaletrain.train.config",
    "EvalResult": "scaletrain.train.loop",
    "evaluate": "scaletrain.train.loop",
    "seed_everything": "scaletrain.train.loop",
    "sync_buffers": "scaletrain.train.loop",
    "train_step": "scaletrain.train.loop",
    "ConvNet": "scaletrain.train.models",
    "RECIPES": "scaletrain.train.recipes",
    "Recipe": "scaletrain.train.recipes",
    "get_recipe": "scaletrain.train.recipes",
    "Trainer": "scaletrain.train.trainer",
}

__all__ = [
    "RECIPES",
    "ConvNet",
    "EvalResult",
    "Recipe",
    "TrainConfig",
    "Trainer",
    "evaluate",
    "get_recipe",
    "seed_everything",
    "sync_buffers",
    "train_step",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'scaletrain.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
