"""scaletrain: scale a plain PyTorch model and training loop to many devices.

import scaletrain as st
rt = st.init(strategy="ddp")
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(dataset, batch_size=100)
"""

from scaletrain.errors import (
    CheckpointError,
    ConfigError,
    DatasetError,
    EnvironmentDetectionError,
    LaunchError,
    ScaletrainError,
)
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

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "FSDP",
    "AccumulationStep",
    "CheckpointError",
    "ConfigError",
    "DataParallel",
    "DatasetError",
    "EnvironmentDetectionError",
    "LaunchError",
    "ModelParallel",
    "Pipeline",
    "Runtime",
    "ScaletrainError",
    "SingleDevice",
    "Strategy",
    "TensorParallel",
    "__version__",
    "init",
    "sync_batchnorm",
]
