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

import fnmatch
from collections.abc import Mapping
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

STYLES = ("colwise", "rowwise", "sequence")
"""Plan values as strings: ColwiseParallel, RowwiseParallel, SequenceParallel."""

ATTENTION_QKV_NAMES: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = (
    ("q_proj", "query", "q", "wq", "to_q", "q_lin"),
    ("k_proj", "key", "k", "wk", "to_k", "k_lin"),
    ("v_proj", "value", "v", "wv", "to_v", "v_lin"),
)
"""Names of an attention block's separate query / key / value projections."""
ATTENTION_OUT_NAMES = ("out_proj", "o_proj", "proj", "c_proj", "wo", "out", "dense", "out_lin")
"""Names of an attention block's output projection."""
MLP_UP_NAMES = ("fc", "fc1", "c_fc", "w1", "up_proj", "lin1", "linear1", "dense_h_to_4h")
"""Names of an MLP's first (widening) Linear."""
MLP_DOWN_NAMES = ("proj", "fc2", "c_proj", "w2", "down_proj", "lin2", "linear2", "dense_4h_to_h")
"""Names of an MLP's second (narrowing) Linear."""
_GATED_MLPS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads", "nhead")
_KV_HEAD_ATTRS = ("n_kv_head", "num_key_value_heads", "n_kv_heads", "num_kv_heads")


_NO_PAIRS_FIX = (
    "expected an MLP (two nn.Linear in sequence, e.g. fc -> proj, c_fc -> c_proj, "
    "up_proj -> down_proj) or attention with separate q/k/v projections and an output "
    "projection (q_proj/k_proj/v_proj -> out_proj); fix: pass plan={'<module name>': "
    "ColwiseParallel() or RowwiseParallel(), ...} or use ddp/fsdp"
)


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
        """The plan for `module`: the user's (keys checked against it) or the default."""
        if self.plan is None:
            return dict(default_tp_plan(module, sequence_parallel=self.sequence_parallel))
        for key in self.plan:
            if not _matching_modules(module, key):
                linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
                shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
                raise ConfigError(
                    f"TensorParallel(plan=...) key {key!r} matches no module of the "
                    f"{type(module).__name__}. Keys are dotted module names, with fnmatch "
                    f"wildcards per part ('blocks.*.mlp.fc'); its Linear layers are: "
                    f"{shown or '(none)'}."
                )
        return dict(self.plan)

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        module = module.to(topo.device)
        # Resolved and checked even in one process, so a model tensor parallel cannot
        # shard fails on a laptop with the same message as at scale.
        plan = self.resolved_plan(module)
        if topo.world_size == 1:
            return module
        mesh = device_mesh(topo, "tp")
        degree = mesh.size()
        check_tp_plan(module, plan, degree)
        if degree == 1:
            return module
        blocks = sequence_parallel_blocks(module, plan) if self.sequence_parallel else None
        names = parameter_names(module)
        from torch.distributed.tensor.parallel import parallelize_module

        styles = {key: _style(value, self.sequence_parallel) for key, value in plan.items()}
        parallelize_module(module, mesh, styles)
        if blocks is not None:
            _slice_and_gather(module, blocks, mesh)
        remember_parameter_names(module, names)
        return module

    def _setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, topo: Topology
    ) -> torch.optim.Optimizer:
        return rebind_to_wrapped(optimizer, module)


# -- the default plan ---------------------------------------------------------------


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _attention(linears: Mapping[str, nn.Linear]) -> dict[str, str] | None:
    picked: list[str] = []
    for names in ATTENTION_QKV_NAMES:
        hit = next((n for n in names if n in linears), None)
        if hit is None:
            return None
        picked.append(hit)
    outs = [n for n in ATTENTION_OUT_NAMES if n in linears and n not in picked]
    if len(outs) != 1:
        return None
    q, k, v = (linears[n] for n in picked)
    out = linears[outs[0]]
    if not (q.in_features == k.in_features == v.in_features and out.in_features == q.out_features):
        return None
    return {**dict.fromkeys(picked, "colwise"), outs[0]: "rowwise"}


def _gated_mlp(linears: Mapping[str, nn.Linear]) -> dict[str, str] | None:
    if len(linears) != 3:
        return None
    for gate, up, down in _GATED_MLPS:
        if {gate, up, down} == set(linears):
            g, u, d = linears[gate], linears[up], linears[down]
            if g.out_features == u.out_features == d.in_features:
                return {gate: "colwise", up: "colwise", down: "rowwise"}
    return None


def _mlp(linears: Mapping[str, nn.Linear]) -> dict[str, str] | None:
    if len(linears) != 2:
        return None
    (n1, a), (n2, b) = linears.items()
    if n1 in MLP_DOWN_NAMES and n2 in MLP_UP_NAMES and n1 not in MLP_UP_NAMES:
        (n1, a), (n2, b) = (n2, b), (n1, a)  # registered in the other order
    if a.out_features != b.in_features:
        return None  # not chained: the second cannot consume the first's output
    named = n1 in MLP_UP_NAMES and n2 in MLP_DOWN_NAMES
    # Unknown names: in registration order, and only the residual-MLP shape (back to
    # the input width), so e.g. a feature extractor + classifier is left alone.
    if not named and a.in_features != b.out_features:
        return None
    return {n1: "colwise", n2: "rowwise"}


def _is_norm(module: nn.Module) -> bool:
    norms: tuple[type[nn.Module], ...] = (nn.LayerNorm,)
    if hasattr(nn, "RMSNorm"):
        norms += (nn.RMSNorm,)
    return isinstance(module, norms) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def default_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, str]:
    """Qualified module name -> "colwise" / "rowwise" / "sequence" for `model`.

    Rules, applied to every module's *direct* nn.Linear children:

    1. Attention: one Linear from each of q/k/v (names in ATTENTION_QKV_NAMES, e.g.
       q_proj/k_proj/v_proj, query/key/value) with the same in_features, plus exactly
       one output projection (ATTENTION_OUT_NAMES: out_proj, o_proj, proj, c_proj, ...)
       whose in_features is q's out_features. q/k/v -> colwise (each rank holds whole
       heads, provided the head count divides), output -> rowwise. Fused projections
       (qkv, c_attn) are left replicated: splitting their columns would hand a rank
       a mix of q, k and v.
    2. Gated MLP: exactly three Linears named gate_proj/up_proj/down_proj or w1/w3/w2
       -> colwise, colwise, rowwise.
    3. MLP: exactly two Linears, the first's out_features equal to the second's
       in_features. Named as in MLP_UP_NAMES -> MLP_DOWN_NAMES (fc -> proj, c_fc ->
       c_proj, up_proj -> down_proj; either registration order), or, with other names,
       in registration order when the pair returns to its input width (d -> h -> d).
       First -> colwise, second -> rowwise.

    Everything else (embeddings, norms, the LM head) stays replicated. With
    `sequence_parallel`, the LayerNorm / RMSNorm children of each block holding
    those modules get "sequence" (see `sequence_parallel_blocks`).

    Raises ConfigError when nothing matches (e.g. a ConvNet).
    """
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        linears = _linear_children(module)
        if len(linears) < 2:
            continue
        found = _attention(linears) or _gated_mlp(linears) or _mlp(linears)
        if found:
            prefix = f"{name}." if name else ""
            plan.update({prefix + child: style for child, style in found.items()})
    if not plan:
        raise ConfigError(
            f"tensor parallel found no Linear pairs to shard in {type(model).__name__}; "
            + _NO_PAIRS_FIX
            + "."
        )
    if sequence_parallel:
        modules = dict(model.named_modules())
        for block in sequence_parallel_blocks(model, plan):
            prefix = f"{block}." if block else ""
            for child, sub in modules[block].named_children():
                if _is_norm(sub):
                    plan[prefix + child] = "sequence"
    return plan


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def sequence_parallel_blocks(model: nn.Module, plan: Mapping[str, Any]) -> list[str]:
    """The blocks that run sequence parallel, in order: the modules holding the planned
    attention / MLP modules (GPT's ``blocks.0``, ``blocks.1``).

    They must be consecutive elements of one ModuleList / Sequential, run one after
    the other: the first one's input is sliced along the sequence and the last one's
    output gathered back, and in between the activations stay sliced.
    """
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}
    holders = {_parent(k) for k, v in plan.items() if v in ("colwise", "rowwise")}
    blocks = sorted({_parent(h) for h in holders if h}, key=order.__getitem__)
    containers = {_parent(b) for b in blocks}
    container = modules[containers.pop()] if len(containers) == 1 else None
    if "" in holders or "" in blocks or not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(
            "TensorParallel(sequence_parallel=True) needs the attention / MLP modules inside "
            "blocks held in one nn.ModuleList or nn.Sequential (like GPT's blocks.0, "
            f"blocks.1, ...); in this {type(model).__name__} they sit in: "
            f"{', '.join(sorted(h or '(the root)' for h in holders))}. "
            "Fix: use sequence_parallel=False."
        )
    members = [modules[b] for b in blocks]
    children = list(container.children())
    idx = [next(i for i, c in enumerate(children) if c is m) for m in members]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ConfigError(
            f"TensorParallel(sequence_parallel=True): the blocks {', '.join(blocks)} are not "
            "consecutive elements of their container, so the sequence slices cannot flow "
            "from one to the next. Fix: use sequence_parallel=False."
        )
    return blocks


# -- checks -------------------------------------------------------------------------


def _matching_modules(model: nn.Module, key: str) -> list[str]:
    # parallelize_module's own matching: fnmatch on each dotted part, same depth.
    parts = key.split(".")
    return [
        name
        for name, _ in model.named_modules()
        if name
        and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatch(a, p) for a, p in zip(name.split("."), parts, strict=True))
    ]


def _kind(style: Any) -> str | None:
    if isinstance(style, str):
        return style
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def _heads(attention: nn.Module, layer: str, width: int) -> int | None:
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0:
        return width // head_dim
    attrs = _HEAD_ATTRS if layer in ATTENTION_QKV_NAMES[0] else _KV_HEAD_ATTRS
    for attr in attrs:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_tp_plan(model: nn.Module, plan: Mapping[str, Any], degree: int) -> None:
    """ConfigError unless every split Linear divides by the tensor-parallel degree.

    Column-parallel layers split out_features, row-parallel ones in_features; a q/k/v
    projection must also hold a multiple of `degree` attention heads (read from its
    parent's ``head_dim``, else ``n_head``/``num_heads``/... attributes).
    """
    modules = dict(model.named_modules())
    qkv = {n for names in ATTENTION_QKV_NAMES for n in names}
    for key, style in plan.items():
        kind = _kind(style)
        if kind not in ("colwise", "rowwise"):
            continue
        for name in _matching_modules(model, key):
            layer = modules[name]
            if not isinstance(layer, nn.Linear):
                continue
            dim, size = (
                ("out_features", layer.out_features)
                if kind == "colwise"
                else ("in_features", layer.in_features)
            )
            if size % degree:
                raise ConfigError(
                    f"tensor parallel cannot split {name} (Linear {layer.in_features} -> "
                    f"{layer.out_features}) {kind} over {degree} ranks: its {dim}={size} is "
                    f"not divisible by the tensor-parallel degree {degree}. Fix: make the "
                    f"width a multiple of {degree} (e.g. n_embd), use a tp degree that "
                    f"divides {size}, or leave {name} out of the plan."
                )
            leaf = name.rpartition(".")[2]
            if kind == "colwise" and leaf in qkv:
                heads = _heads(modules[_parent(name)], leaf, layer.out_features)
                if heads is not None and heads % degree:
                    raise ConfigError(
                        f"tensor parallel cannot split the attention heads of "
                        f"{_parent(name) or type(model).__name__}: {name} holds {heads} "
                        f"heads (out_features={layer.out_features}), not divisible by the "
                        f"tensor-parallel degree {degree}, so a rank would get part of a "
                        f"head. Fix: use a head count that is a multiple of {degree} "
                        "(n_head), or a tp degree that divides it."
                    )


# -- applying it --------------------------------------------------------------------


def _style(value: Any, sequence_parallel: bool) -> ParallelStyle:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not isinstance(value, str):
        return value
    if value == "sequence":
        return SequenceParallel()
    if not sequence_parallel:
        return ColwiseParallel() if value == "colwise" else RowwiseParallel()
    # Between blocks the activations are sliced on the sequence (dim 1): a colwise
    # layer gathers them (all-gather) and a rowwise layer hands back its slice
    # (reduce-scatter instead of all-reduce). Gathering per layer rather than once per
    # attention module (torchtitan's PrepareModuleInput) costs one all-gather per q/k/v
    # but needs no knowledge of the attention's forward signature.
    if value == "colwise":
        return ColwiseParallel(input_layouts=Shard(1))
    return RowwiseParallel(output_layouts=Shard(1))


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
