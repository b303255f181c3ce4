"""scaletrain: scale a plain PyTorch model and training loop to many devices.

import scaletrain as st
rt = st.init(strategy="ddp")
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(dataset, batch_size=100)

st.launch(train, nproc=2, args=(...)) runs a function on 2 new processes (each may
call st.init()) and returns their results in rank order.

The public names are imported on first use (PEP 562): `import scaletrain` and the
`scaletrain` command's --help and --version do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain._lazy import lazy_attributes

__version__ = "0.1.0"

if TYPE_CHECKING:
    from scaletrain.checkpoint import CheckpointManager
    from scaletrain.errors import (
        CheckpointError,
        ConfigError,
        DatasetError,
        EnvironmentDetectionError,
        LaunchError,
        RankError,
        ScaletrainError,
    )
    from scaletrain.exitcodes import EXIT_PREEMPTED
    from scaletrain.launch.function import launch_function as launch  # st.launch: callable
    from scaletrain.observe.metrics.ledger import LedgerConfig
    from scaletrain.observe.report.trackers import MLflowTracker, TensorBoardTracker, Tracker
    from scaletrain.planner.api import plan
    from scaletrain.runtime import AccumulationStep, Runtime, init, sync_batchnorm
    from scaletrain.strategies import (
        DDP,
        FSDP,
        DataParallel,
        ModelParallel,
        Pipeline,
        SingleDevice,
        Strategy,
        TensorParallel,
    )

_WHERE = {
    "CheckpointManager": "scaletrain.checkpoint",
    "EXIT_PREEMPTED": "scaletrain.exitcodes",
    "CheckpointError": "scaletrain.errors",
    "ConfigError": "scaletrain.errors",
    "DatasetError": "scaletrain.errors",
    "EnvironmentDetectionError": "scaletrain.errors",
    "LaunchError": "scaletrain.errors",
    "RankError": "scaletrain.errors",
    "ScaletrainError": "scaletrain.errors",
    "AccumulationStep": "scaletrain.runtime",
    "Runtime": "scaletrain.runtime",
    "LedgerConfig": "scaletrain.observe.metrics.ledger",
    "MLflowTracker": "scaletrain.observe.report.trackers",
    "TensorBoardTracker": "scaletrain.observe.report.trackers",
    "Tracker": "scaletrain.observe.report.trackers",
    "init": "scaletrain.runtime",
    "launch": "scaletrain.launch",
    "plan": "scaletrain.planner.api",
    "sync_batchnorm": "scaletrain.runtime",
    "DDP": "scaletrain.strategies",
    "FSDP": "scaletrain.strategies",
    "DataParallel": "scaletrain.strategies",
    "ModelParallel": "scaletrain.strategies",
    "Pipeline": "scaletrain.strategies",
    "SingleDevice": "scaletrain.strategies",
    "Strategy": "scaletrain.strategies",
    "TensorParallel": "scaletrain.strategies",
}

__all__ = [
    "DDP",
    "EXIT_PREEMPTED",
    "FSDP",
    "AccumulationStep",
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "DataParallel",
    "DatasetError",
    "EnvironmentDetectionError",
    "LaunchError",
    "LedgerConfig",
    "MLflowTracker",
    "ModelParallel",
    "Pipeline",
    "RankError",
    "Runtime",
    "ScaletrainError",
    "SingleDevice",
    "Strategy",
    "TensorBoardTracker",
    "TensorParallel",
    "Tracker",
    "__version__",
    "init",
    "launch",
    "plan",
    "sync_batchnorm",
]


__getattr__, __dir__ = lazy_attributes("scaletrain", globals(), _WHERE)
