"""Numeric precision: autocast, loss scaling and FSDP policies, one small class.

"32"          float32 everywhere (default).
"bf16-mixed"  weights and optimizer in float32, forward in bfloat16 (autocast),
              on CPU and GPU. Under FSDP: MixedPrecisionPolicy(bf16 params,
              fp32 gradient reduction).
"fp16-mixed"  autocast to float16 with dynamic loss scaling (GradScaler): GPUs only.
"bf16-true"   weights, activations and gradients in bfloat16 (half the memory,
              less accuracy); inputs are cast for you.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scaletrain import spellings
from scaletrain.errors import ConfigError, spell, unknown

__all__ = ["AUTOCAST_DTYPES", "PRECISIONS", "Precision", "canonical"]

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "bf16-true")
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
"""The mixed precisions' autocast dtypes (the others autocast nothing)."""


def canonical(name: str) -> str:
    """A precision's own name for one of its other spellings (`bf16`: bf16-mixed)."""
    return str(spellings.canonical("precision", str(name)))


@dataclass(kw_only=True, slots=True)
class Precision:
    """How this run computes: its autocast context, scaler and parameter dtype."""

    name: str = "32"
    """One of PRECISIONS."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The device the run computes on (autocast and GradScaler are per device type)."""
    scaler: Any = None
    """torch.amp.GradScaler for fp16-mixed, else None."""
    autocast: bool = True
    """False when the strategy casts itself (FSDP's MixedPrecisionPolicy)."""
    shared: bool = field(default=False, init=False)
    """The loss scaler's overflow check is summed over the ranks that hold different
    gradients (`share_overflow`)."""
    _unscaled: set[int] = field(default_factory=set, init=False, repr=False)
    """Optimizers unscale() unscaled since their last step (by id)."""

    def __post_init__(self) -> None:
        self.name = canonical(self.name)
        if self.name not in PRECISIONS:
            raise ConfigError(unknown("precision", self.name, PRECISIONS), field="precision")
        if self.name == "fp16-mixed":
            if self.device.type != "cuda":
                raise ConfigError(
                    f"{spell('precision', 'fp16-mixed')} needs a CUDA GPU (float16 with dynamic "
                    f"loss scaling), but this run computes on {self.device.type}. Fix: "
                    f"{spell('precision', 'bf16-mixed')}, which needs no loss scaling and runs "
                    "on CPUs too.",
                    field="precision",
                )
            if self.scaler is None:
                self.scaler = torch.amp.GradScaler("cuda")
        if (
            self.name in ("bf16-mixed", "bf16-true")
            and self.device.type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigError(
                f"{spell('precision', self.name)}: this GPU has no bfloat16 support. Fix: "
                f"{spell('precision', 'fp16-mixed')} (with loss scaling) or "
                f"{spell('precision', '32')}.",
                field="precision",
            )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES.get(self.name)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for the forward pass (and the loss computed on its outputs)."""
        dtype = self.autocast_dtype
        if dtype is None or not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """bf16-true keeps the weights themselves in bfloat16."""
        if self.name == "bf16-true":
            return module.to(torch.bfloat16)
        return module

    def convert_input(self, data: Any) -> Any:
        """bf16-true: floating inputs follow the weights' dtype (token ids stay ints)."""
        if self.name == "bf16-true" and isinstance(data, torch.Tensor) and data.is_floating_point():
            return data.to(torch.bfloat16)
        return data

    def fsdp_policy(self) -> Any:
        """FSDP2's MixedPrecisionPolicy for this precision (None: none needed)."""
        dtype = self.autocast_dtype
        if dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # Parameters are all-gathered in low precision; gradients reduced in fp32 so
        # summing many ranks' gradients does not lose the small ones.
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def share_overflow(self, group: Any) -> None:
        """Under loss scaling, make the ranks of `group` (pipeline stages,
        `Strategy.model_parallel_group`) step as one. Each holds its own plain gradients
        and finds its own inf or NaN: ShardedGradScaler sums each step's finding over the
        group first, or one stage skipped the step while the others took it and their
        scales parted. Only the last stage computes the loss, and so scales it: the
        others' scale is made here, or their first step found none and failed. (Sharded
        DTensor gradients agree already: DTensor reduces the check over their mesh; data
        parallel replicas' gradients are equal.)"""
        if self.scaler is None or group is None:
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(self.device.type, process_group=group)
        scaler.load_state_dict(self.scaler.state_dict())
        scaler.scale(torch.ones((), device=self.device))  # its scale, on this device
        self.scaler, self.shared = scaler, True

    def loss_scale(self) -> torch.Tensor | float:
        """The factor scale() multiplies by, without a GPU sync (a tensor under fp16)."""
        if self.scaler is None:
            return 1.0
        # GradScaler.get_scale() calls .item(): a device sync on every step. The scale
        # tensor itself (the private accessor GradScaler.step uses) keeps it on device.
        scale = self.scaler._get_scale_async()
        return scale if scale is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        if self.shared and id(optimizer) not in self._unscaled:
            # A fused optimizer (fused=True) checks for overflow inside its own step, on
            # this rank's gradients alone: unscale_ first sums the check over the group.
            self.scaler.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        self.scaler.step(optimizer)
        self.scaler.update()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients true-sized before clipping (once per step)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
