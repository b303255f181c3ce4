"""DistributedDataParallel: one replica per process, gradients all-reduced in buckets.

With `device_map` each replica is itself model parallel: the process owns several
devices and its copy of the model is split over them (the seeds' "DDP with model
parallel", `gpus = {0: [0, 1], 1: [2, 3]}[rank]`), as a one-liner:

    st.DDP(device_map={"sub_net1": "local:0", "sub_net2": "local:1"})

"local:i" is the i-th device of this process: local rank r owning k devices owns
GPUs r*k .. r*k+k-1, with k = `devices_per_process`, or by default the number of
local devices the map names (2 above; for "auto", the node's GPUs divided by its
processes). Placement follows the rules of strategies/placement.py; where no
GPU is visible every device is the CPU, so the same script runs on CPUs.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletrain.errors import ConfigError, article
from scaletrain.strategies.base import Strategy, register
from scaletrain.strategies.devices import (
    check_device_map,
    local_devices_needed,
    process_devices,
    resolve_device_map,
)
from scaletrain.strategies.placement import place_module

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology

__all__ = ["COMM_HOOKS", "DDP"]

COMM_HOOKS = ("fp16", "bf16", "powersgd")


@register
@dataclass(kw_only=True, slots=True)
class DDP(Strategy):
    """Data parallel over processes with torch's DistributedDataParallel."""

    name: ClassVar[str] = "ddp"

    bucket_cap_mb: float | None = None
    """Gradient bucket size in MiB; None keeps PyTorch's default (25)."""
    static_graph: bool = False
    """Promise the graph is the same every step: lets DDP skip per-step bookkeeping."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the communication buckets: saves one gradient-sized copy of memory."""
    find_unused_parameters: bool = False
    """Walk the autograd graph each step to find parameters that got no gradient."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm running stats) to every rank before each forward."""
    comm_hook: str | None = None
    """Gradient compression: "fp16", "bf16" (CUDA+NCCL only), "powersgd", or None."""
    powersgd_rank: int = 1
    """Matrix approximation rank for comm_hook="powersgd"."""
    powersgd_start_iter: int = 10
    """Plain all-reduce for this many steps before PowerSGD compression starts."""
    device_map: dict[str, str] | str | None = None
    """Model parallel in each replica: submodule -> "local:i"/"cuda:i"/"cpu", or "auto"."""
    devices_per_process: int | None = None
    """Devices each process owns for device_map; None: as many as its "local:i" name."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ConfigError(
                f"DDP(comm_hook={self.comm_hook!r}) is not a known hook; expected one of "
                f"{', '.join(COMM_HOOKS)} or None."
            )
        if self.bucket_cap_mb is not None and (
            isinstance(self.bucket_cap_mb, bool)
            or not isinstance(self.bucket_cap_mb, (int, float))
            or self.bucket_cap_mb <= 0
        ):
            raise ConfigError(
                f"DDP(bucket_cap_mb={self.bucket_cap_mb!r}) must be positive, e.g. 25 (MiB)."
            )
        rank = self.powersgd_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"DDP(powersgd_rank={self.powersgd_rank!r}) must be >= 1.")
        if self.device_map is not None:
            check_device_map(self.device_map, "DDP")
        if self.devices_per_process is not None:
            if self.device_map is None:
                raise ConfigError(
                    f"DDP(devices_per_process={self.devices_per_process!r}) only applies with "
                    "a device_map, e.g. DDP(device_map='auto', devices_per_process=2)."
                )
            if self.devices_per_process < 1:
                raise ConfigError(
                    f"DDP(devices_per_process={self.devices_per_process!r}) must be >= 1."
                )

    def process_devices(self, topo: Topology) -> list[str]:
        """The devices this process owns for its device_map (all "cpu" without GPUs)."""
        gpus = torch.cuda.device_count() if topo.device.type == "cuda" else 0
        if self.devices_per_process is not None:
            per_process = self.devices_per_process
        elif isinstance(self.device_map, str):  # "auto": share the node's GPUs evenly
            per_process = max(gpus // max(topo.local_world_size, 1), 1)
        else:
            per_process = max(local_devices_needed(self.device_map or {}), 1)
        return process_devices(topo.local_rank, per_process, gpu_count=gpus)

    def home_device(self, topo: Topology) -> torch.device:
        if self.device_map is None or topo.device.type != "cuda":
            return topo.device
        return torch.device(self.process_devices(topo)[0])

    def _validate(self, topo: Topology) -> None:
        if self.comm_hook == "bf16" and (topo.backend != "nccl" or topo.device.type != "cuda"):
            raise ConfigError(
                "DDP(comm_hook='bf16') needs CUDA and the NCCL backend (PyTorch's "
                f"bf16_compress_hook), but this run uses backend={topo.backend!r} on "
                f"{topo.device.type}. Use comm_hook='fp16' on CPU/Gloo, or run on GPUs."
            )
        if self.device_map is not None:
            owned = self.process_devices(topo)
            if not isinstance(self.device_map, str):
                resolve_device_map(self.device_map, owned, "DDP")

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        if self.device_map is None:
            module = module.to(topo.device)
        else:
            place_module(module, self.device_map, devices=self.process_devices(topo), owner="DDP")
        self.apply_float8(module)
        self.apply_levers(module)
        if topo.world_size == 1:
            # The same script runs in one process with no wrapper and no process group.
            return module
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"DDP got {article(type(module).__name__)} with no trainable parameters; DDP has "
                "nothing to synchronise. Check requires_grad, or use strategy='single'."
            )
        kwargs: dict[str, Any] = {
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "find_unused_parameters": self.find_unused_parameters,
        }
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
            # torch >= 2.13 renamed it and warns on the old name.
            kwargs["forward_sync_buffers"] = self.broadcast_buffers
        else:
            kwargs["broadcast_buffers"] = self.broadcast_buffers
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        devices = {p.device for p in module.parameters()}
        if len(devices) == 1 and (only := next(iter(devices))).type == "cuda":
            # The module's own GPU: with a device_map it need not be topo.device.
            kwargs["device_ids"] = [only]
            kwargs["output_device"] = only
        # Several devices in one process (DDP with model parallel): DDP must not be
        # given device_ids then; it reduces across the devices the module spans.
        ddp = DistributedDataParallel(module, **kwargs)
        self._register_hook(ddp)
        return ddp

    def _register_hook(self, ddp: DistributedDataParallel) -> None:
        if self.comm_hook is None:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        group = dist.group.WORLD
        if self.comm_hook == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif self.comm_hook == "bf16":
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            # Not batched_powerSGD_hook: in torch 2.13 it raises a bare AssertionError.
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()
