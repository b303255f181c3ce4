"""Composing parallelisms on a 2-D DeviceMesh: FSDP x tensor, DDP x pipeline.

`st.init(strategy=..., mesh={"dp": 2, "tp": 2})` lays the ranks on a mesh
(outermost first: pp, dp, tp) and this module builds the composite:

- "dp" x "tp": tensor parallel inside each group of `tp` neighbouring ranks (the
  fastest links: one node), FSDP2 across the groups on the "dp" dimension. The
  strategy named may be "fsdp" (default for this pair) or "tensor".
- "dp" x "pp": pipeline stages along "pp", data parallel along "dp" with DDP's
  semantics: replicas start from the same weights and every stage's gradients are
  averaged over its "dp" peers after the pipeline's backward (one flat all-reduce
  per step; unlike torch's DDP it is not overlapped with the backward, because the
  stages are traced lazily and rebuilt per batch shape). The strategy named may be
  "ddp" (default for this pair) or "pipeline".
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.dist.mesh import device_mesh
from scaletrain.errors import ConfigError, spell
from scaletrain.strategies.base import (
    Strategy,
    parameter_names,
    rebind_to_wrapped,
    remember_parameter_names,
)
from scaletrain.strategies.ddp import DDP
from scaletrain.strategies.float8 import precompute_scales_after_steps
from scaletrain.strategies.fsdp import FSDP, wrap_targets
from scaletrain.strategies.pipeline import Pipeline, PipelineModule
from scaletrain.strategies.pipeline.strategy import refuse_ac_every, refuse_float8
from scaletrain.strategies.tensor import TensorParallel

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology
    from scaletrain.precision import Precision

__all__ = ["FSDPxTP", "PipelinexDDP", "compose"]


@dataclass(kw_only=True, slots=True)
class FSDPxTP(Strategy):
    """Tensor parallel on the "tp" mesh dimension, FSDP2 on "dp"."""

    name: ClassVar[str] = "fsdp+tensor"
    # Without a mesh (built directly, not by compose) it is tensor parallel over every rank.
    mesh_dim: ClassVar[str] = "tp"

    fsdp: FSDP = field(default_factory=FSDP)
    """How the data-parallel dimension shards (FSDP's options)."""
    tensor: TensorParallel = field(default_factory=TensorParallel)
    """How the tensor-parallel dimension shards (plan, sequence parallel)."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        self.fsdp, self.tensor = _lift_levers(self, (self.fsdp, self.tensor))

    def _validate(self, topo: Topology) -> None:
        self.tensor.validate(topo)
        self.fsdp.validate(topo)

    def adopt_precision(self, precision: Precision, topo: Topology) -> None:
        self.fsdp.adopt_precision(precision, topo)

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        self.tensor.check_model(module, topo)
        self.fsdp.check_model(module, topo)

    def _blocks(self, module: nn.Module) -> list[str] | None:
        return wrap_targets(module, self.fsdp.wrap)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        if self.float8:
            # First (levers.py), so tensor parallel picks float8 styles for the float8
            # layers and FSDP gathers their weights in float8; the names the user's
            # optimizer knows are taken before the all-gather's new Parameters.
            remember_parameter_names(module, parameter_names(module))
            self.apply_float8(module, fsdp_all_gather=topo.size("dp") > 1)
        module = self.tensor.setup_module(module, topo)
        # Between the two: after tensor parallel's sharding, before FSDP's (levers.py).
        self.apply_levers(module)
        if topo.size("dp") > 1:
            # FSDP2 shards the TP DTensors along the other mesh dimension (2-D DTensors).
            module = self.fsdp.setup_module(module, topo)
        return module

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        # Tensor parallel remembered the names first; FSDP's wrapping keeps them.
        optimizer = rebind_to_wrapped(optimizer, module)
        precompute_scales_after_steps(optimizer, module)
        return optimizer

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.fsdp.no_sync(module)


@dataclass(kw_only=True, slots=True)
class PipelinexDDP(Strategy):
    """Pipeline stages on the "pp" mesh dimension, data parallel (DDP semantics) on "dp"."""

    name: ClassVar[str] = "pipeline+ddp"
    # Without a mesh (built directly, not by compose) it is a pipeline over every rank.
    mesh_dim: ClassVar[str] = "pp"

    pipeline: Pipeline = field(default_factory=Pipeline)
    """How the model is split into stages and scheduled."""
    _syncing: bool = field(default=True, repr=False)
    _dp_group: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        (self.pipeline,) = _lift_levers(self, (self.pipeline,))
        if self.float8:
            refuse_float8()
        refuse_ac_every(self.ac_every, "PipelinexDDP(...)")
        # The pipeline applies them, to its stages (its own copy: see _lift_levers).
        self.pipeline.ac, self.pipeline.compile = self.ac, self.compile

    def _validate(self, topo: Topology) -> None:
        self.pipeline.validate(topo)

    def _blocks(self, module: nn.Module) -> list[str] | None:
        return self.pipeline._blocks(module)

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        self.pipeline.check_model(module, topo)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        if topo.size("dp") > 1:
            # DDP's promise: every replica starts from dp-rank 0's weights and buffers.
            group = self._dp_group = device_mesh(topo, "dp").get_group()
            src = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(tensor.data, src=src, group=group)
        return self.pipeline.setup_module(module, topo)

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        return self.pipeline.setup_optimizer(optimizer, module, topo)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return self.pipeline.unwrap(module)

    def model_parallel_group(self, topo: Topology) -> Any:
        return self.pipeline.model_parallel_group(topo)

    def batch_splits(self) -> int:
        return self.pipeline.batch_splits()

    def _full_state_dict(self, module: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return self.pipeline.full_state_dict(module, topo)

    @contextlib.contextmanager
    def _sync_off(self) -> Iterator[None]:
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._sync_off()

    def forward_backward(
        self,
        module: nn.Module,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        loss = self.pipeline.forward_backward(module, inputs, targets, loss_fn)
        if self._syncing and isinstance(module, PipelineModule):
            _average_gradients(module, self._dp_group)
        return loss

    def _predict(self, module: nn.Module, inputs: Any) -> Any:
        return self.pipeline.predict(module, inputs)

    def prepare(self, module: nn.Module, example_inputs: Any) -> None:
        self.pipeline.prepare(module, example_inputs)

    def checkpoint_module(self, module: nn.Module) -> nn.Module:
        return self.pipeline.checkpoint_module(module)


def _lift_levers(composite: Strategy, parts: tuple[Strategy, ...]) -> tuple[Any, ...]:
    """Make the composite the one owner of the levers (float8, checkpointing, compile):
    set on one of its parts (compose() wraps the user's st.FSDP(ac="full")), they move
    up, so no block is converted, checkpointed or compiled twice. Returns copies of the
    parts without them: the user's own strategy objects keep their settings (one reused
    later without a mesh still checkpoints)."""
    copies = tuple(copy.copy(part) for part in parts)
    for part in copies:
        if not part.uses_levers:
            continue
        if composite.uses_levers:
            raise ConfigError(
                f"{type(composite).__name__}: ac/compile/float8 are set on more than one of "
                "its parts. Fix: set them once, on the strategy you name."
            )
        composite.ac, composite.ac_every, composite.compile = part.ac, part.ac_every, part.compile
        composite.float8 = part.float8
        part.ac, part.ac_every, part.compile, part.float8 = "none", None, False, False
        Strategy.__post_init__(composite)
    return copies


def _average_gradients(module: PipelineModule, group: Any) -> None:
    """Average this rank's stage gradients over its data-parallel peers, in one call."""
    if group is None:
        return
    local = set(module.stage_parameter_names())
    grads = [
        p.grad
        for name, p in module.module.named_parameters()
        if name in local and p.grad is not None
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def compose(strategy: Strategy, mesh: Mapping[str, int]) -> Strategy:
    """The composite for a mesh with "tp" or "pp" > 1, from the strategy the user named."""
    tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
    shape = ", ".join(f"{k}={v}" for k, v in mesh.items())
    if tp > 1 and pp > 1:
        raise ConfigError(
            f"mesh {{{shape}}} combines tensor and pipeline parallel; scaletrain composes "
            "two dimensions at a time: dp x tp (FSDP x tensor) or dp x pp (DDP x pipeline). "
            "Drop one of tp/pp.",
            field="mesh",
        )
    if tp > 1:
        if isinstance(strategy, FSDP):
            return FSDPxTP(fsdp=strategy)
        if isinstance(strategy, TensorParallel):
            return FSDPxTP(tensor=strategy)
        if isinstance(strategy, FSDPxTP):
            return strategy
        raise ConfigError(
            f"{spell('strategy', strategy.name)} with mesh {{{shape}}}: a 'tp' dimension "
            f"composes with FSDP on 'dp'. Fix: {spell('strategy', 'fsdp')} (or "
            f"{spell('strategy', 'tensor')}) with this mesh.",
            field="strategy",
        )
    if isinstance(strategy, DDP):
        if strategy.device_map is not None:
            raise ConfigError(
                "DDP(device_map=...) with a 'pp' mesh dimension: pipeline stages already "
                "place the model; drop the device map."
            )
        return PipelinexDDP(
            ac=strategy.ac,
            ac_every=strategy.ac_every,
            compile=strategy.compile,
            float8=strategy.float8,
        )
    if isinstance(strategy, Pipeline):
        return PipelinexDDP(pipeline=strategy)
    if isinstance(strategy, PipelinexDDP):
        return strategy
    raise ConfigError(
        f"strategy {strategy.name!r} with mesh {{{shape}}}: a 'pp' dimension composes with "
        "DDP on 'dp'. Use strategy='ddp' (or 'pipeline') with this mesh."
    )
