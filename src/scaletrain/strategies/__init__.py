"""One module per parallelism; each registers itself under its user-facing name."""

from scaletrain.strategies.base import STRATEGIES, Strategy, register, resolve_strategy
from scaletrain.strategies.ddp import COMM_HOOKS, DDP
from scaletrain.strategies.dp import DataParallel
from scaletrain.strategies.model_parallel import ModelParallel, auto_device_map
from scaletrain.strategies.single import SingleDevice

__all__ = [
    "COMM_HOOKS",
    "DDP",
    "STRATEGIES",
    "DataParallel",
    "ModelParallel",
    "SingleDevice",
    "Strategy",
    "auto_device_map",
    "register",
    "resolve_strategy",
]
