"""Launching: `scaletrain launch`, a thin layer over PyTorch's elastic launcher
(torch.distributed.launcher, what torchrun runs), and `st.launch(fn, nproc=N,
args=...)`, which runs a Python function on N processes.

`st.launch(...)` is this package, called: importing `scaletrain.launch` binds the name
`launch` on `scaletrain` to this module (Python sets a subpackage as an attribute of its
parent), so the module itself is made callable; the call goes to
scaletrain.launch.function.launch_function. `scaletrain.launch.launch` stays the
function that runs a script (`scaletrain launch SCRIPT`).
"""

import sys
import types
from typing import Any

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


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """st.launch(fn, *, nproc=None, args=()): see scaletrain.launch.function."""
        from scaletrain.launch.function import launch_function

        return launch_function(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
