"""One module per parallelism; each registers itself under its user-facing name."""

from scaletrain.strategies.base import STRATEGIES, Strategy, register, resolve_strategy
from scaletrain.strategies.ddp import COMM_HOOKS, DDP
from scaletrain.strategies.dp import DataParallel
from scaletrain.strategies.fsdp import FSDP
from scaletrain.strategies.mesh import FSDPxTP, PipelinexDDP, compose
from scaletrain.strategies.model_parallel import ModelParallel, auto_device_map
from scaletrain.strategies.pipeline import SCHEDULES, Pipeline, PipelineModule
from scaletrain.strategies.single import SingleDevice
from scaletrain.strategies.tensor import TensorParallel

__all__ = [
    "COMM_HOOKS",
    "DDP",
    "FSDP",
    "SCHEDULES",
    "STRATEGIES",
    "DataParallel",
    "FSDPxTP",
    "ModelParallel",
    "Pipeline",
    "PipelineModule",
    "PipelinexDDP",
    "SingleDevice",
    "Strategy",
    "TensorParallel",
    "auto_device_map",
    "compose",
    "register",
    "resolve_strategy",
]
