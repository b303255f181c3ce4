"""Single-process model parallel: submodules on several devices from a device map.

The seeds' `Net("cuda:0", "cuda:1")` hard-codes `.to(gpu)` calls into the model.
Here the model stays plain and a map says where each part lives:

    st.ModelParallel(device_map={"sub_net1": "cuda:0", "sub_net2": "cuda:1"})
    st.ModelParallel(device_map="auto")          # balance parameters over local GPUs

Placement follows the rule in strategies/placement.py; device strings and "auto"
are described in strategies/devices.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.strategies.base import Strategy, register
from scaletrain.strategies.devices import (
    auto_device_map,
    check_device_map,
    local_devices_needed,
    process_devices,
    resolve_device_map,
    visible_devices,
)
from scaletrain.strategies.placement import (
    DevicePlan,
    Placement,
    move_to_device,
    place_module,
    plan_device_map,
)

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology

__all__ = [
    "DevicePlan",
    "ModelParallel",
    "Placement",
    "auto_device_map",
    "check_device_map",
    "local_devices_needed",
    "move_to_device",
    "place_module",
    "plan_device_map",
    "process_devices",
    "resolve_device_map",
    "visible_devices",
]


@register
@dataclass(kw_only=True, slots=True)
class ModelParallel(Strategy):
    """One process, the model's submodules on several devices (the seeds' `Net(gpus)`).

    Only one device computes at a time: this fits a model too large for one GPU,
    it does not make it faster. For speed across processes add data parallel
    (`st.DDP(device_map=...)`) or use pipeline parallel.
    """

    name: ClassVar[str] = "model-parallel"

    device_map: dict[str, str] | str = "auto"
    """Submodule name -> device ("cuda:0", "cpu", "local:i"), or "auto" to balance parameters."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        check_device_map(self.device_map, "ModelParallel")

    def _validate(self, topo: Topology) -> None:
        if topo.world_size > 1:
            raise ConfigError(
                f"strategy 'model-parallel' places one model over the devices of ONE process, "
                f"but this job has {topo.world_size} processes, which would each train alone. "
                "For several processes each owning several devices use "
                "st.DDP(device_map={'sub_net1': 'local:0', 'sub_net2': 'local:1'}) "
                "(DDP with model parallel), or start a single process."
            )
        if isinstance(self.device_map, Mapping):
            resolve_device_map(self.device_map, visible_devices(), "ModelParallel")

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        place_module(module, self.device_map, owner="ModelParallel")
        self.apply_float8(module)
        self.apply_levers(module)
        return module

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        _follow_parameters(optimizer)
        return optimizer


def _follow_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Move optimizer state (momentum, Adam moments) to the device of its parameter.

    Placement keeps the Parameter objects, so the optimizer still holds them; state
    from steps taken before setup would stay behind on the old device.
    """
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        for key, value in state.items():
            # Scalar step counters live on the CPU on purpose (torch.optim); leave them.
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[key] = value.to(param.device)
