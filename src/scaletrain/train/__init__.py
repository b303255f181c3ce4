"""The training loop behind `scaletrain train`, its config, and the seeds' recipes.

Names are imported on first use, so `scaletrain.train.config` (what the CLI reads
to build its flags) comes without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain._lazy import lazy_attributes

if TYPE_CHECKING:
    from scaletrain.train.config import TrainConfig
    from scaletrain.train.loop import (
        EvalResult,
        evaluate,
        seed_everything,
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
    "train_step",
]


__getattr__, __dir__ = lazy_attributes("scaletrain.train", globals(), _WHERE)
