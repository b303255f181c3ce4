"""Launching: `scaletrain launch`, a thin layer over PyTorch's torch.distributed.run."""

from scaletrain.launch.cli import add_arguments, run
from scaletrain.launch.config import LaunchConfig
from scaletrain.launch.failures import record_failure, summarize_failure
from scaletrain.launch.launcher import (
    build_torchrun_args,
    dry_run_command,
    format_torchrun_command,
    launch,
)

__all__ = [
    "LaunchConfig",
    "add_arguments",
    "build_torchrun_args",
    "dry_run_command",
    "format_torchrun_command",
    "launch",
    "record_failure",
    "run",
    "summarize_failure",
]
