"""The training loop behind `scaletrain train`, its config, and the seeds' recipes."""

from scaletrain.train.config import TrainConfig
from scaletrain.train.recipes import RECIPES, ConvNet, Recipe, get_recipe
from scaletrain.train.trainer import EvalResult, Trainer, evaluate, seed_everything, sync_buffers

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
]
