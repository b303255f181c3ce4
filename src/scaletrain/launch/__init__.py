"""Launching: `scaletrain launch`, a thin layer over PyTorch's torch.distributed.run."""

from scaletrain.launch.cli import add_arguments, run
from scaletrain.launch.config import LaunchConfig
from scaletrain.launch.launcher import build_torchrun_args, format_torchrun_command, launch

__all__ = [
    "LaunchConfig",
    "add_arguments",
    "build_torchrun_args",
    "format_torchrun_command",
    "launch",
    "run",
]
