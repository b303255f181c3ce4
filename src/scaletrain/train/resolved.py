"""config.json: a run's settings with every default filled in, and the facts of the run.

Replayed with `scaletrain train --config RUN/config.json`, it trains the same run; the
`run` section (world size, environment, versions) is read by people, not by --config.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.train.config import TrainConfig

if TYPE_CHECKING:
    from scaletrain.runtime import Runtime

__all__ = ["resolved_config"]


def resolved_config(config: TrainConfig, rt: Runtime, **values: Any) -> dict[str, Any]:
    """config.json: every setting with its default filled in, then the run's facts."""
    resolved = config.replace(**values).to_dict()
    resolved["run"] = {
        "world_size": rt.world_size,
        "nodes": rt.env.num_nodes,
        "data_parallel_size": rt.dp_size,
        "device": rt.device.type,
        "environment": rt.env.kind,
        # Where it was started: a model or data module named by a relative path
        # (`--model mymodel.py:build`) is found from there again (`plan --check`).
        "directory": os.getcwd(),
        "versions": {
            "scaletrain": _version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    return resolved


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("scaletrain")
    except PackageNotFoundError:
        return "unknown"
