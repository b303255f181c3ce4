"""Which Linear layers tensor parallel splits, and whether they divide: the plan.

`declared_tp_plan` reads the plan a model declares (Hugging Face's
`base_model_tp_plan`); `default_tp_plan` finds MLPs and attention blocks by their
layers' names and shapes,
so plain models (the GPT in scaletrain.train.models) need no plan; `check_tp_plan`
refuses a split that would hand a rank part of a row, a column or a head; and
`explain_fixed_head_counts` turns the bare shape error of an attention whose forward
hard-codes its head count into a message that says what to change.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from scaletrain.errors import ConfigError, say, spell

__all__ = [
    "ATTENTION_OUT_NAMES",
    "ATTENTION_QKV_NAMES",
    "MLP_DOWN_NAMES",
    "MLP_UP_NAMES",
    "STYLES",
    "attention_modules",
    "check_tp_plan",
    "declared_tp_plan",
    "default_tp_plan",
    "explain_fixed_head_counts",
    "matching_modules",
    "sequence_parallel_blocks",
]

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


_NO_PAIRS = (
    "expected an MLP (two nn.Linear in sequence, e.g. fc -> proj, c_fc -> c_proj, "
    "up_proj -> down_proj) or attention with separate q/k/v projections and an output "
    "projection (q_proj/k_proj/v_proj -> out_proj)"
)


def _no_pairs_fix() -> str:
    return say(
        api="fix: pass plan={'<module name>': ColwiseParallel() or RowwiseParallel(), ...} "
        "or use ddp/fsdp",
        cli=f"Fix: {spell('strategy', 'ddp')} or {spell('strategy', 'fsdp')} for this "
        f"recipe, or {spell('recipe', 'gpt')}, whose blocks tensor parallel can split",
    )


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


def declared_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a model declares for itself, in this module's words; None if it has none.

    Hugging Face models carry one: `config.base_model_tp_plan`, keyed by module names
    inside the base model (`layers.*.self_attn.q_proj`), which a task model such as
    LlamaForCausalLM holds under its `base_model_prefix` (`model`). Its "colwise" and
    "rowwise" entries are the styles this module applies; a plan with others (Hugging
    Face's own "gather", "local_colwise", ...) is refused with the fix, since applying
    part of it would split layers their neighbours expect whole.
    """
    declared = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not isinstance(declared, Mapping) or not declared:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = prefix if isinstance(getattr(model, prefix, None), nn.Module) and prefix else ""
    others = sorted({str(v) for v in declared.values()} - {"colwise", "rowwise"})
    if others:
        raise ConfigError(
            f"{type(model).__name__} declares a tensor-parallel plan "
            f"(config.base_model_tp_plan) with styles {', '.join(others)}, which scaletrain "
            "does not apply (it applies colwise and rowwise). "
            + say(
                api="Fix: pass TensorParallel(plan={...}) with ColwiseParallel/RowwiseParallel "
                "(or other torch ParallelStyle) values for its layers",
                cli=f"Fix: {spell('strategy', 'fsdp')}, or the library's "
                "TensorParallel(plan=...) with the layouts you want",
            )
            + "."
        )
    return {(f"{base}.{key}" if base else key): str(style) for key, style in declared.items()}


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
            + _NO_PAIRS
            + "; "
            + _no_pairs_fix()
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


def matching_modules(model: nn.Module, key: str) -> list[str]:
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
        for name in matching_modules(model, key):
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


def attention_modules(model: nn.Module, plan: Mapping[str, Any]) -> list[str]:
    """The modules whose q/k/v projections the plan splits column-wise (attention blocks)."""
    qkv = {n for names in ATTENTION_QKV_NAMES for n in names}
    found: set[str] = set()
    for key, style in plan.items():
        if _kind(style) != "colwise":
            continue
        for name in matching_modules(model, key):
            if name.rpartition(".")[2] in qkv:
                found.add(_parent(name))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=order.__getitem__)


def explain_fixed_head_counts(model: nn.Module, plan: Mapping[str, Any], degree: int) -> None:
    """Make an attention whose forward hard-codes its head count fail with a fix.

    Column-parallel q/k/v hand each rank 1/degree of the heads, so a forward doing
    `q.view(b, t, self.n_head, head_dim)` gets a tensor of 1/degree the size and torch
    raises a bare "shape '[4, 8, 4, 6]' is invalid for input of size 384". Each such
    module's forward is wrapped to turn exactly that error into a ConfigError naming
    the module and the change: read the local head count from the tensor (-1).
    """
    modules = dict(model.named_modules())
    for name in attention_modules(model, plan):
        module = modules[name]
        original = module.forward
        heads = next(
            (v for a in _HEAD_ATTRS if isinstance(v := getattr(module, a, None), int) and v > 0),
            None,
        )

        def forward(
            *args: Any,
            _original: Any = original,
            _name: str = name,
            _module: nn.Module = module,
            _heads: int | None = heads,
            **kwargs: Any,
        ) -> Any:
            try:
                return _original(*args, **kwargs)
            except RuntimeError as exc:
                if "is invalid for input of size" not in str(exc):
                    raise
                share = (
                    f"{_heads // degree} of its {_heads} heads"
                    if _heads
                    else f"1/{degree} of its heads"
                )
                raise ConfigError(
                    f"tensor parallel: {_name or 'the model'} ({type(_module).__name__}) "
                    f"reshapes its q/k/v outputs with its full head count, but its q/k/v "
                    f"projections are split over {degree} ranks, so each rank holds {share} "
                    f"and torch refuses the reshape ({exc}). Fix: in its forward, infer the "
                    f"local head count from the tensor, e.g. q.view(b, t, -1, head_dim) "
                    f"instead of q.view(b, t, n_head, head_dim) (or n_head // {degree}); "
                    "scaletrain's GPT (scaletrain.train.models) does so."
                ) from exc

        module.forward = forward
