"""The levers of large-model training: float8, activation checkpointing, torch.compile.

All three act on a model's blocks (scaletrain.strategies.blocks: the units FSDP
shards), in place, so parameter names and checkpoint keys stay the user's own:

- Activation checkpointing (`ac`) keeps a block's input and recomputes the rest
  of its forward during backward: memory for compute. "full" does it for every
  block; "selective" either for every k-th block (`ac_every=k`) or, without
  `ac_every`, for every block at the op level: matrix multiplications, attention
  and reduce-scatters keep their outputs (see selective_keeps), the cheap ones (norms, activations, elementwise) are recomputed
  (torch.utils.checkpoint's selective policies). Eagerly, the recomputation runs
  the same ops on the same inputs with the RNG state restored, so losses and
  gradients are bitwise those of no checkpointing (compiled, the compiler may fuse
  the recomputed ops differently: within rounding).
- torch.compile (`compile`) compiles each block on its own (`Module.compile`, in
  place, so no `_orig_mod.` enters the names): every block shares one compiled
  graph, so compile time does not grow with depth. A model with no blocks is
  compiled whole.

- float8 training (`float8`) swaps the nn.Linear layers inside the blocks for
  torchao's Float8Linear (its own module: scaletrain.strategies.float8).

The order matters, and the strategies apply the levers at the point where it
holds: float8 first, then tensor parallel, then checkpointing, then compile, then
FSDP or DDP. float8 replaces modules (Float8Linear for nn.Linear) and, for FSDP's
float8 all-gather, wraps each weight in a tensor subclass that FSDP's hooks know
how to gather in float8: both must be in place before tensor parallel picks its
float8 styles by module type (Float8ColwiseParallel casts a layer's input to
float8 before its all-gather) and before FSDP shards the wrapped weights; and the
casts are ops inside each block's forward that the checkpoint recomputes and the
compiler fuses (float8 pays off only compiled: eager, the casts and scale
computations are separate kernels that cost more than the faster matmuls save).
Tensor parallel swaps parameters for DTensors and adds its redistributions to
each block's forward, which the checkpoint must recompute and compile must
trace; checkpointing goes inside the compiled region so the compiler sees the
recomputation and its selective policy (a checkpoint around a compiled block
could not apply op-level policies); FSDP comes last because its all-gathers and
reduce-scatters are hooks around each block that run eagerly, outside the
compiled graphs, overlapping with them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, say, spell
from scaletrain.strategies.blocks import _BLOCKS, auto_wrap_targets

__all__ = [
    "AC_MODES",
    "apply_levers",
    "check_compiler",
    "check_levers",
    "compile_backend",
    "lever_blocks",
    "selective_keeps",
    "selective_policy",
]

AC_MODES = ("none", "full", "selective")
"""Activation checkpointing modes: none, full (every block), selective."""

_MARK = "_scaletrain_levers"


def check_levers(owner: str, ac: object, ac_every: object, compile: object) -> None:
    """Raise ConfigError for lever settings that cannot work, in the words of the
    interface in use (`owner` such as "FSDP(...)" prefixes the library's)."""
    where = say(api=f"{owner}: ", cli="")
    if ac not in AC_MODES:
        raise ConfigError(
            f"{where}{spell('ac', ac)} is not a checkpointing mode; expected one of "
            f"{', '.join(AC_MODES)}.",
            field="ac",
        )
    if ac_every is not None:
        if isinstance(ac_every, bool) or not isinstance(ac_every, int) or ac_every < 1:
            raise ConfigError(
                f"{where}{spell('ac_every', ac_every)} must be a whole number >= 1 (checkpoint "
                "every k-th block).",
                field="ac_every",
            )
        if ac != "selective":
            raise ConfigError(
                f"{where}{spell('ac_every', ac_every)} picks every k-th block for "
                f"{spell('ac', 'selective')}, not {spell('ac', ac)}. Fix: "
                f"{spell('ac', 'selective')}, or drop {spell('ac_every')}.",
                field="ac_every",
            )
    if not isinstance(compile, (bool, str)) or compile == "":
        raise ConfigError(
            f"{where}compile={compile!r} must be True (inductor), False, or the name of a "
            "torch.compile backend such as 'aot_eager'.",
            field="compile",
        )
    if isinstance(compile, str):
        from torch._dynamo import list_backends

        known = sorted({*list_backends(exclude_tags=()), "inductor"})
        if compile not in known:
            raise ConfigError(
                f"{where}compile={compile!r} is not a torch.compile backend; expected True "
                f"(inductor) or one of {', '.join(known)}.",
                field="compile",
            )


def compile_backend(compile: bool | str) -> str | None:
    """The torch.compile backend `compile` asks for: None for no compile."""
    if compile is False:
        return None
    return "inductor" if compile is True else compile


def check_compiler(device: torch.device, compile: bool | str = True) -> None:
    """torch.compile's CPU code generator builds C++ with the system compiler: refuse
    `compile` on a CPU run without one, before anything starts, rather than fail
    inside the first step. (On CUDA it generates Triton kernels instead.)"""
    if device.type != "cpu" or compile_backend(compile) != "inductor":
        return
    wanted = os.environ.get("CXX")
    candidates = [wanted] if wanted else ["g++", "clang++", "c++"]
    if not any(shutil.which(c) for c in candidates if c):
        raise ConfigError(
            f"{spell('compile', True)} on the CPU needs a C++ compiler, and none of "
            f"{', '.join(c for c in candidates if c)} is on PATH. Fix: install one "
            "(apt install g++), or train without compile.",
            field="compile",
        )


_SAVED_OPS: tuple[str, ...] = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)
"""What op-level selective checkpointing keeps: the ops whose recomputation costs
most (matrix multiplications and attention) and the reduce-scatter of tensor
parallel's sequence-parallel outputs (a collective recomputed is a collective
every peer must join again). Names, not objects: ops a torch build lacks are
skipped."""


@functools.cache
def _saved_ops() -> frozenset[Any]:
    ops = set()
    for name in _SAVED_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        target = getattr(packet, overload, None) if packet is not None else None
        if target is not None:
            ops.add(target)
    return frozenset(ops)


def selective_keeps(op: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> bool:
    """Whether op-level selective checkpointing keeps this call's output (else it is
    recomputed): an expensive op (_SAVED_OPS), unless this call drew random numbers.

    The recomputation restores the RNG state of the block's start and redraws its
    random ops in order; a kept op that drew numbers in forward (attention with
    dropout on CUDA) would draw nothing then and shift every later mask. So such a
    call is recomputed too (attention without dropout, the usual case, is kept)."""
    return op in _saved_ops() and not _draws_random(op, args, kwargs or {})


def _draws_random(op: Any, args: tuple[Any, ...], kwargs: Any) -> bool:
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return True


def selective_policy() -> Callable[[], Any]:
    """A `context_fn` for torch.utils.checkpoint: the op-level selective policy."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (
            CheckpointPolicy.MUST_SAVE if selective_keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _checkpoint(
    module: nn.Module, context_fn: Callable[[], Any] | None, compiled: bool = False
) -> None:
    """Make `module`'s forward checkpointed, in place (its class and names unchanged).

    The recomputation reruns the forward in training mode: BatchNorm's running
    statistics (found by buffer name, which a traced pipeline stage keeps) are put back
    as it ends, or they were updated twice a step. Compiled, the checkpoint takes no
    context of ours (the compiler recomputes pure ops, not buffer updates)."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward
    options: dict[str, Any] = {"use_reentrant": False}
    stats = [b for n, b in module.named_buffers() if n.rpartition(".")[2] in _RUNNING_STATS]
    if stats and not compiled:
        options["context_fn"] = functools.partial(_stats_kept, stats, context_fn)
    elif context_fn is not None:
        options["context_fn"] = context_fn

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            # Evaluation keeps nothing for a backward: nothing to recompute.
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, **options, **kwargs)

    module.forward = forward


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
"""BatchNorm's buffers that its training-mode forward updates."""


def _stats_kept(stats: list[torch.Tensor], context_fn: Callable[[], Any] | None) -> Any:
    """checkpoint's (forward, recompute) contexts: `context_fn`'s (or none), the
    recomputation's also putting back the buffers `stats` as it ends."""
    forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
    return forward, _restored(stats, recompute)


@contextlib.contextmanager
def _restored(stats: list[torch.Tensor], inner: Any) -> Iterator[None]:
    saved = [(b, b.clone()) for b in stats]
    try:
        with inner:
            yield
    finally:  # also when the recomputation stops early, having made what it needs
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def lever_blocks(
    model: nn.Module,
    ac: str,
    blocks: Sequence[str] | None = None,
    owner: str = "strategy",
    doing: str = "train",
) -> list[str]:
    """The blocks the levers act on (default: auto_wrap_targets); ConfigError when
    checkpointing is asked of a model that has none. Works on the meta device, so a
    launcher refuses such a model before any process starts. `doing`: what the caller
    does with the model ("train", "plan"), in the refusal's fix."""
    names = list(auto_wrap_targets(model) if blocks is None else blocks)
    if ac != "none" and not names:
        raise ConfigError(
            f"{say(api=f'{owner}: ', cli='')}{spell('ac', ac)} checkpoints a model's "
            f"repeated blocks, and this {type(model).__name__} has none. {_BLOCKS} Fix: "
            f"group its layers into such blocks, or {doing} with {spell('ac', 'none')}.",
            field="ac",
        )
    return names


def apply_levers(
    model: nn.Module,
    *,
    ac: str = "none",
    ac_every: int | None = None,
    compile: bool | str = False,
    blocks: Sequence[str] | None = None,
    owner: str = "strategy",
    doing: str = "train",
) -> list[str]:
    """Checkpoint and/or compile `model`'s blocks in place; returns the blocks acted on.

    `blocks` are qualified module names (default: auto_wrap_targets). Applying the
    levers twice to one model is refused: a block checkpointed twice would recompute
    twice. `doing`: what the caller does with the model ("train", "plan"), in a
    refusal's fix.
    """
    if ac == "none" and not compile:
        return []
    check_levers(owner, ac, ac_every, compile)
    if getattr(model, _MARK, None) is not None:
        raise ConfigError(
            f"{owner}: this {type(model).__name__} already had activation checkpointing or "
            "compile applied; set them once, on the strategy that sets the model up."
        )
    names = lever_blocks(model, ac, blocks, owner, doing)
    modules = dict(model.named_modules())
    # Full: every block whole. Selective: every block's cheap ops (the op policy), or
    # with ac_every, every k-th block whole.
    policy = selective_policy() if ac == "selective" and ac_every is None else None
    for i, name in enumerate(names):
        if ac == "full" or (ac == "selective" and (ac_every is None or i % ac_every == 0)):
            _checkpoint(modules[name], policy, bool(compile))
    if compile:
        # Per block when there are blocks: one graph serves them all (the compiler
        # inlines the module and takes its parameters as inputs).
        for target in [modules[n] for n in names] or [model]:
            target.compile(backend=compile_backend(compile))
    object.__setattr__(model, _MARK, (ac, ac_every, compile))
    return names
