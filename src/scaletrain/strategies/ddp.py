"""DistributedDataParallel: one replica per process, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletrain.errors import ConfigError
from scaletrain.strategies.base import Strategy, register

if TYPE_CHECKING:
    from scaletrain.runtime import Runtime

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

    def __post_init__(self) -> None:
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ConfigError(
                f"DDP(comm_hook={self.comm_hook!r}) is not a known hook; expected one of "
                f"{', '.join(COMM_HOOKS)} or None."
            )
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ConfigError(
                f"DDP(bucket_cap_mb={self.bucket_cap_mb!r}) must be positive, e.g. 25 (MiB)."
            )
        if self.powersgd_rank < 1:
            raise ConfigError(f"DDP(powersgd_rank={self.powersgd_rank!r}) must be >= 1.")

    def _validate(self, rt: Runtime) -> None:
        if self.comm_hook == "bf16" and (rt.backend != "nccl" or rt.device.type != "cuda"):
            raise ConfigError(
                "DDP(comm_hook='bf16') needs CUDA and the NCCL backend (PyTorch's "
                f"bf16_compress_hook), but this run uses backend={rt.backend!r} on "
                f"{rt.device.type}. Use comm_hook='fp16' on CPU/Gloo, or run on GPUs."
            )

    def _setup_module(self, module: nn.Module, rt: Runtime) -> nn.Module:
        module = module.to(rt.device)
        if rt.world_size == 1:
            # The same script runs in one process with no wrapper and no process group.
            return module
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"DDP got a {type(module).__name__} with no trainable parameters; DDP has "
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
        if rt.device.type == "cuda" and len(devices) == 1:
            kwargs["device_ids"] = [rt.device]
            kwargs["output_device"] = rt.device
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
            # batched_powerSGD_hook raises a bare AssertionError in 2.13 (NOTES.md).
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def _unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def _no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()
