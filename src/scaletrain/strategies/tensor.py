"""Tensor parallel: each layer's weight matrices split over the "tp" ranks (Megatron style).

An MLP's first Linear is split by output columns and its second by input rows, so
the hidden activation stays sharded between them and one all-reduce per MLP puts
the output back together; attention does the same with q/k/v (each rank runs its
share of the heads) and the output projection. Every rank of a tensor-parallel
group computes the same model on the SAME batch: they are one replica.

With ``sequence_parallel=True`` the activations between those layers are also
split, along the sequence: LayerNorms, residuals and dropout run on 1/N of the
tokens, the all-reduce becomes a reduce-scatter plus an all-gather, and activation
memory shrinks by N. The strategy slices the blocks' input and gathers their
output itself, so the training loop and the logits are the same as without it.

Built on torch's DTensor `parallelize_module`; `default_tp_plan` finds the layers
so that plain models (the GPT in scaletrain.train.models) need no plan.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
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
from scaletrain.strategies.tensor_plan import (
    ATTENTION_OUT_NAMES,
    ATTENTION_QKV_NAMES,
    MLP_DOWN_NAMES,
    MLP_UP_NAMES,
    STYLES,
    check_tp_plan,
    declared_tp_plan,
    default_tp_plan,
    explain_fixed_head_counts,
    matching_modules,
    sequence_parallel_blocks,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from scaletrain.dist.topology import Topology

__all__ = [
    "ATTENTION_OUT_NAMES",
    "ATTENTION_QKV_NAMES",
    "MLP_DOWN_NAMES",
    "MLP_UP_NAMES",
    "STYLES",
    "TensorParallel",
    "check_tp_plan",
    "default_tp_plan",
    "sequence_parallel_blocks",
]

# torch.distributed.tensor.parallel costs ~0.8 s to import: imported where used.


@register
@dataclass(kw_only=True, slots=True)
class TensorParallel(Strategy):
    """Split Linear layers over the tensor-parallel ranks with torch's DTensor."""

    name: ClassVar[str] = "tensor"
    # Every tensor-parallel peer computes the same replica on the same data: alone,
    # the strategy spans "tp" and only a "dp" mesh dimension splits the data.
    mesh_dim: ClassVar[str] = "tp"

    plan: dict[str, ParallelStyle | str] | None = None
    """Module name (fnmatch wildcards per dotted part) -> ParallelStyle or "colwise" /
    "rowwise" / "sequence"; None finds MLPs and attention (see default_tp_plan)."""
    sequence_parallel: bool = False
    """Also split the activations between layers along the sequence (dim 1)."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(
                f"TensorParallel(sequence_parallel={self.sequence_parallel!r}) must be True "
                "or False."
            )
        if self.plan is None:
            return
        if not isinstance(self.plan, Mapping) or not self.plan:
            raise ConfigError(
                f"TensorParallel(plan={self.plan!r}) must be a non-empty dict of module name "
                "-> ParallelStyle, e.g. {'blocks.*.mlp.fc': ColwiseParallel(), "
                "'blocks.*.mlp.proj': RowwiseParallel()}, or None for the default plan."
            )
        from torch.distributed.tensor.parallel import ParallelStyle

        for key, style in self.plan.items():
            if not isinstance(key, str) or not key:
                raise ConfigError(
                    f"TensorParallel(plan=...) has key {key!r}; keys are module names such "
                    "as 'blocks.0.mlp.fc' or 'blocks.*.mlp.fc'."
                )
            if not (isinstance(style, ParallelStyle) or style in STYLES):
                raise ConfigError(
                    f"TensorParallel(plan=...) maps {key!r} to {style!r}; expected a "
                    "torch.distributed.tensor.parallel ParallelStyle (ColwiseParallel(), "
                    f"RowwiseParallel(), ...) or one of {', '.join(map(repr, STYLES))}."
                )
        if self.sequence_parallel:
            raise ConfigError(
                "TensorParallel(sequence_parallel=True) applies to the default plan; with "
                "plan=... the plan owns the layouts. Fix: drop plan= to use the default "
                "plan, or put SequenceParallel() and the Shard(1) input/output layouts in "
                "your plan and leave sequence_parallel=False."
            )

    def _validate(self, topo: Topology) -> None:
        if topo.world_size > 1 and topo.mesh_given and "tp" not in topo.mesh_shape:
            raise ConfigError(
                f"strategy='tensor' needs a 'tp' dimension, but the mesh is {topo.mesh_shape}. "
                "Add it, e.g. mesh={'dp': 2, 'tp': 2}, or give no mesh to use every rank."
            )

    def resolved_plan(self, module: nn.Module) -> dict[str, Any]:
        """The plan for `module`: the user's (keys checked against it), else the one the
        model declares (a Hugging Face model's base_model_tp_plan), else the default."""
        if self.plan is None:
            declared = None if self.sequence_parallel else declared_tp_plan(module)
            if declared is not None:
                return declared
            return dict(default_tp_plan(module, sequence_parallel=self.sequence_parallel))
        for key in self.plan:
            if not matching_modules(module, key):
                linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
                shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
                raise ConfigError(
                    f"TensorParallel(plan=...) key {key!r} matches no module of the "
                    f"{type(module).__name__}. Keys are dotted module names, with fnmatch "
                    f"wildcards per part ('blocks.*.mlp.fc'); its Linear layers are: "
                    f"{shown or '(none)'}."
                )
        return dict(self.plan)

    def _check_model(self, module: nn.Module, topo: Topology) -> None:
        plan = self.resolved_plan(module)
        degree = topo.size("tp")
        if degree > 1:
            check_tp_plan(module, plan, degree)
            if self.sequence_parallel:
                sequence_parallel_blocks(module, plan)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        # float8 before the sharding (levers.py): the float8 layers get float8 styles.
        self.apply_float8(module)
        # Resolved and checked even in one process, so a model tensor parallel cannot
        # shard fails on a laptop with the same message as at scale.
        plan = self.resolved_plan(module)
        if topo.world_size == 1:
            self.apply_levers(module)
            return module
        mesh = device_mesh(topo, "tp")
        degree = mesh.size()
        check_tp_plan(module, plan, degree)
        if degree == 1:
            self.apply_levers(module)
            return module
        blocks = sequence_parallel_blocks(module, plan) if self.sequence_parallel else None
        names = parameter_names(module)
        from torch.distributed.tensor.parallel import parallelize_module

        # Gloo has no float8 collectives (NCCL has): float8 all-gathers on NCCL only.
        float8_comms = topo.backend == "nccl"
        shared: dict[str, Any] = {}
        styles = _float8_styles(module, plan, self.sequence_parallel, float8_comms, shared) or {
            key: _style(value, self.sequence_parallel, shared) for key, value in plan.items()
        }
        parallelize_module(module, mesh, styles)
        _forget_shared_input(module, plan, shared)
        explain_fixed_head_counts(module, plan, degree)
        if blocks is not None:
            _slice_and_gather(module, blocks, mesh)
        # After the sharding: the checkpoint recomputes, and compile traces, the
        # redistributions tensor parallel added to each block.
        self.apply_levers(module)
        remember_parameter_names(module, names)
        return module

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        optimizer = rebind_to_wrapped(optimizer, module)
        if self.sequence_parallel:
            optimizer.register_step_pre_hook(_reduce_partial_grads)
        return optimizer


def _reduce_partial_grads(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Sum the gradients sequence parallel leaves partial, once, before the step.

    The parameters it replicates (the blocks' norms) get each rank's sum over its slice
    of the sequence: Partial DTensors. Each optimizer op on one all-reduces it first,
    and again at the next op (AdamW: three times a step); summed here once, the step
    computes the same values on Replicate gradients."""
    from torch.distributed.tensor import DTensor, Replicate

    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if isinstance(grad, DTensor) and any(x.is_partial() for x in grad.placements):
                whole = [Replicate() if x.is_partial() else x for x in grad.placements]
                p.grad = grad.redistribute(grad.device_mesh, whole)


# -- applying it --------------------------------------------------------------------


def _style(value: Any, sequence_parallel: bool, shared: dict[str, Any]) -> ParallelStyle:
    """torch's style for a plan's string: "colwise" a `_sharing_colwise` layer (over
    `shared`), "rowwise" RowwiseParallel, "sequence" SequenceParallel; a ParallelStyle
    of the user's own as given."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    if not isinstance(value, str):
        return value
    if value == "sequence":
        return SequenceParallel()
    colwise = _sharing_colwise()
    if not sequence_parallel:
        return colwise(shared) if value == "colwise" else RowwiseParallel()
    # Between blocks the activations are sliced on the sequence (dim 1): a colwise
    # layer gathers them (all-gather) and a rowwise layer hands back its slice
    # (reduce-scatter instead of all-reduce).
    if value == "colwise":
        return colwise(shared, input_layouts=Shard(1))
    return RowwiseParallel(output_layouts=Shard(1))


@functools.cache
def _sharing_colwise() -> Callable[..., ParallelStyle]:
    """ColwiseParallel whose layers share one redistribution of an input they take
    together: q, k and v of one attention (a gated MLP's gate and up) all read the
    same tensor, and torch's style turns it into a DTensor in each layer. That is an
    all-reduce of its gradient per layer in the backward (sequence parallel: an
    all-gather per layer in the forward, a reduce-scatter per layer in the backward).
    Shared, the layers' gradients add up on the one DTensor first, and the
    redistribution's backward runs once: Megatron's one collective per attention or
    MLP. torchtitan gets there by handing the attention module itself a DTensor
    (PrepareModuleInput); this needs nothing of the module's forward, which may be any
    model's. The sharing is by identity (the same tensor object, kept alive with its
    DTensor, under the same grad mode), so a layer taking another input (a
    cross-attention's k and v) converts its own; `_forget_shared_input` drops the
    tensor once its module returns."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    class SharingColwise(ColwiseParallel):
        def __init__(self, shared: dict[str, Any], **layouts: Any) -> None:
            super().__init__(**layouts)
            self.shared = shared

        def _prepare_input_fn(  # type: ignore[override]  # bound: it reads self.shared
            self,
            input_layouts: Any,
            desired_input_layouts: Any,
            mod: nn.Module,
            inputs: tuple[Any, ...],
            device_mesh: DeviceMesh,
        ) -> Any:
            x = inputs[0]  # a local tensor, or a DTensor (a SequenceParallel norm's output)
            grad = torch.is_grad_enabled()  # one made under no_grad carries no gradient
            shared = self.shared
            same = shared.get("input") is x and shared.get("mesh") is device_mesh
            if same and shared.get("grad") is grad:
                return shared["dtensor"]
            dtensor = ColwiseParallel._prepare_input_fn(
                input_layouts, desired_input_layouts, mod, inputs, device_mesh
            )
            shared.update(input=x, mesh=device_mesh, grad=grad, dtensor=dtensor)
            return dtensor

    return SharingColwise


def _forget_shared_input(
    module: nn.Module, plan: Mapping[str, Any], shared: dict[str, Any]
) -> None:
    """Hooks: the modules holding the plan's colwise layers (an attention, an MLP; above
    a ModuleList or ModuleDict, which is never called, the module that holds it) drop
    the input their layers shared when they are called and when they return, and so
    does the model, so the cache never holds an activation past its module (a
    gathered one, under sequence parallel) nor one step's input into the next. (A
    reentrant checkpoint of one colwise layer recomputes it in the backward, after every
    module returned: that input stays until the next forward begins.)"""
    modules = dict(module.named_modules())
    holders = {""}
    for key, value in plan.items():
        for name in matching_modules(module, key) if value == "colwise" else ():
            holder = name.rpartition(".")[0]
            while holder and isinstance(modules[holder], (nn.ModuleList, nn.ModuleDict)):
                holder = holder.rpartition(".")[0]
            holders.add(holder)

    def forget(*_: Any) -> None:
        shared.clear()

    for name in holders:
        modules[name].register_forward_pre_hook(forget)
        modules[name].register_forward_hook(forget, always_call=True)


def _float8_styles(
    module: nn.Module,
    plan: Mapping[str, Any],
    sequence_parallel: bool,
    float8_comms: bool,
    shared: dict[str, Any],
) -> dict[str, ParallelStyle] | None:
    """The plan with torchao's float8 styles for the float8 layers it names as "colwise" or
    "rowwise"; None for torch's own styles everywhere: when the model has no float8
    layers, or with sequence parallel where the backend has no float8 collectives
    (`float8_comms` False: Gloo).

    Float8ColwiseParallel and Float8RowwiseParallel cast a layer's input to float8
    before tensor parallel redistributes it, so with sequence parallel the all-gather
    of the sequence moves float8 (half of bf16's bytes), and cast its output's gradient
    to float8 in backward. They take only Float8Linear layers, so the plan's patterns
    are expanded to the modules they match and each gets the style its type takes.
    torch's plain styles also work on float8 layers (the matmuls in float8, the
    collectives in the activations' precision); ParallelStyle objects of the user's own
    are applied as given."""
    float8_linear = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    modules = dict(module.named_modules())
    if float8_linear is None or not any(isinstance(m, float8_linear) for m in modules.values()):
        return None
    if sequence_parallel and not float8_comms:
        return None
    from torch.distributed.tensor import Shard
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    styles: dict[str, ParallelStyle] = {}
    for key, value in plan.items():
        names = matching_modules(module, key)
        if value not in ("colwise", "rowwise") or not any(
            isinstance(modules[n], float8_linear) for n in names
        ):
            styles[key] = _style(value, sequence_parallel, shared)
            continue
        for name in names:
            if not isinstance(modules[name], float8_linear):
                styles[name] = _style(value, sequence_parallel, shared)
            elif value == "colwise":
                styles[name] = (
                    Float8ColwiseParallel(input_layouts=Shard(1))
                    if sequence_parallel
                    else Float8ColwiseParallel()
                )
            else:
                styles[name] = (
                    Float8RowwiseParallel(output_layouts=Shard(1))
                    if sequence_parallel
                    else Float8RowwiseParallel()
                )
    return styles


def _slice_and_gather(model: nn.Module, blocks: list[str], mesh: DeviceMesh) -> None:
    """Hooks: the first block takes this rank's slice of the sequence, the last block's
    output is gathered whole, so everything outside the blocks sees full tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    modules = dict(model.named_modules())
    degree = mesh.size()

    def take_slice(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if x.dim() < 2 or x.shape[1] % degree:
            raise ConfigError(
                f"TensorParallel(sequence_parallel=True) splits the sequence (dim 1) over "
                f"{degree} ranks, but {blocks[0]} got an input of shape {tuple(x.shape)}. "
                f"Fix: use sequence lengths divisible by {degree}, or sequence_parallel=False."
            )
        # Replicate -> Shard is a local slice; its backward all-gathers the gradient.
        local = (
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            .redistribute(mesh, [Shard(1)])
            .to_local()
        )
        return (local, *args[1:])

    def gather(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return (
            DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
            .redistribute(mesh, [Replicate()])
            .to_local()
        )

    modules[blocks[0]].register_forward_pre_hook(take_slice)
    modules[blocks[-1]].register_forward_hook(gather)
