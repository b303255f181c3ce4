"""Fully sharded data parallel (FSDP2): parameters, gradients and optimizer state sharded.

Each process holds 1/N of every parameter (a DTensor sharded on dim 0 over the
"dp" mesh). A unit's parameters are all-gathered just before its forward (and
again before its backward), and gradients are reduce-scattered after it, so a
unit is the granularity of communication and of peak memory: the default shards
each transformer block (or each conv stage) as its own unit, then the root for
whatever is left (embeddings, head).

torch's `fully_shard` works in place: the module keeps its class and names, only
its parameters become DTensors, so `unwrap` is the module itself.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from scaletrain.dist.mesh import device_mesh
from scaletrain.errors import ConfigError
from scaletrain.strategies.base import (
    Strategy,
    parameter_names,
    rebind_to_wrapped,
    register,
    remember_parameter_names,
)
from scaletrain.strategies.blocks import WrapSpec, auto_wrap_targets, normalise_wrap, wrap_targets
from scaletrain.strategies.float8 import precompute_scales_after_steps

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from scaletrain.dist.topology import Topology
    from scaletrain.precision import Precision

__all__ = ["FSDP", "WrapSpec", "auto_wrap_targets", "wrap_targets"]

# torch.distributed.fsdp costs ~0.8 s to import: it is imported where it is used, so
# `import scaletrain` stays fast for DDP users.


@register
@dataclass(kw_only=True, slots=True)
class FSDP(Strategy):
    """Shard parameters, gradients and optimizer state over the data-parallel ranks."""

    name: ClassVar[str] = "fsdp"

    wrap: WrapSpec = None
    """Units sharded on their own: None/"auto" (each block, see auto_wrap_targets), or
    module classes / class names, e.g. (Block,) or ("Block",)."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (re-gather in backward): less memory."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA runs)."""
    mixed_precision: MixedPrecisionPolicy | None = None
    """A torch.distributed.fsdp.MixedPrecisionPolicy, or None for the parameters' dtype."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        self.wrap = normalise_wrap(self.wrap)
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(
                f"FSDP(reshard_after_forward={self.reshard_after_forward!r}) must be True or False."
            )
        if not isinstance(self.cpu_offload, bool):
            raise ConfigError(f"FSDP(cpu_offload={self.cpu_offload!r}) must be True or False.")
        if self.mixed_precision is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mixed_precision, MixedPrecisionPolicy):
                raise ConfigError(
                    f"FSDP(mixed_precision={self.mixed_precision!r}) must be a "
                    "torch.distributed.fsdp.MixedPrecisionPolicy or None. Fix: for a "
                    "precision by name, st.init(precision='bf16-mixed') (FSDP takes its "
                    "policy from it), or a policy of your own, e.g. "
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                    "reduce_dtype=torch.float32)."
                )

    def _validate(self, topo: Topology) -> None:
        # cpu_offload is accepted on every device. On CUDA it keeps the shards in pinned
        # host memory; on a CPU run they live there already, so it changes nothing and
        # still works (measured on Gloo), and one config file serves a laptop and a GPU
        # cluster. Pinning needs an accelerator ("Cannot access accelerator device when
        # none is available"), so _setup_module asks for it on CUDA only.
        if self.cpu_offload and topo.size("dp") == 1 and topo.device.type != "cpu":
            # One data-parallel rank (one process, or a mesh of dp=1) is never sharded:
            # its states stay on the device, which a user who asks for offload cannot afford.
            warnings.warn(
                f"FSDP(cpu_offload=True) with one data-parallel rank on {topo.device.type}: "
                "FSDP has nothing to shard there and leaves the model unwrapped, so its "
                "parameters, gradients and optimizer state stay on the device, not in host "
                "memory. Offload takes 2 data-parallel ranks or more (torchrun "
                "--nproc-per-node 2, or a mesh with dp=2).",
                UserWarning,
                stacklevel=3,
            )

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        wrap_targets(module, self.wrap)

    def _blocks(self, module: nn.Module) -> list[str] | None:
        return wrap_targets(module, self.wrap)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        # Resolved even in one process: a wrong class name fails on a laptop, not at scale.
        targets = wrap_targets(module, self.wrap)
        # Before float8, whose all-gather wraps the weights in new Parameters: the
        # names the user's optimizer was built with.
        names = parameter_names(module)
        # float8, checkpointing and compile act on the units FSDP shards, before it
        # shards them; float8's weights all-gather in float8 where there is a gather.
        self.apply_float8(module, fsdp_all_gather=topo.world_size > 1, blocks=targets)
        self.apply_levers(module, targets)
        if topo.world_size == 1:
            # One process: nothing to shard; the same script runs unwrapped (and
            # adopt_precision left autocast on).
            return module
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {
            "mesh": device_mesh(topo, "dp"),
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": (
                MixedPrecisionPolicy() if self.mixed_precision is None else self.mixed_precision
            ),
        }
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=topo.device.type == "cuda")
        submodules = dict(module.named_modules())
        norms: list[str] = []
        policy = kwargs["mp_policy"]
        if policy.param_dtype not in (None, torch.float32):
            # BatchNorm keeps float32 weights beside its float32 running statistics, as
            # FSDP1's MixedPrecision kept _BatchNorm out of its cast by default (FSDP2's
            # policy has no such default): batch_norm refuses bf16 weights with float32
            # statistics, and takes the bf16 activations beside float32 weights, as under
            # autocast. Each is a unit of its own (or is one already, as a target) with
            # the policy's reduction; inside a compiled block, a graph break.
            norms = [n for n, m in submodules.items() if n and _affine_norm(m)]
        keep = {**kwargs, "mp_policy": MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype)}
        # Innermost first: a unit's parameters belong to the innermost unit holding them,
        # and fully_shard must see nested units before the ones around them (a
        # BatchNorm holds no other module's parameters).
        for name in [n for n in norms if n not in targets] + targets[::-1]:
            fully_shard(submodules[name], **(keep if name in norms else kwargs))
        # The root gathers what no unit claimed (embeddings, head, final norm) and
        # drives the schedule: it must be sharded last.
        fully_shard(module, **kwargs)
        remember_parameter_names(module, names)
        return module

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        optimizer = rebind_to_wrapped(optimizer, module)
        precompute_scales_after_steps(optimizer, module)
        return optimizer

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module

    def adopt_precision(self, precision: Precision, topo: Topology) -> None:
        # FSDP casts parameters itself when it all-gathers them (MixedPrecisionPolicy):
        # cheaper than autocast re-casting every op, and gradients reduce in fp32.
        policy = precision.fsdp_policy()
        if policy is not None and self.mixed_precision is None:
            self.mixed_precision = policy
        # One data-parallel rank (one process, or a mesh of dp=1 x tp) is never sharded
        # (_setup_module, FSDPxTP): the precision the policy would have applied falls
        # back to autocast there.
        if self.mixed_precision is not None and topo.size("dp") > 1:
            precision.autocast = False

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _gradient_sync_off(module)


def _affine_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine


@contextlib.contextmanager
def _gradient_sync_off(module: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    # FSDP2 then keeps unsharded gradients and accumulates into them; the first
    # backward after the block reduce-scatters the sum.
    module.set_requires_gradient_sync(False, recurse=True)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True, recurse=True)
