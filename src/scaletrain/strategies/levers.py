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
  torchao's Float8Linear, whose matrix multiplications take float8 inputs scaled
  per tensor (torch._scaled_mm on GPUs of compute capability 8.9 and newer). The
  embeddings, the output head and anything else outside the blocks stay in high
  precision, as do layers whose input or output width is not a multiple of 16 (the
  float8 kernels' rule). Float8Linear keeps the layer's own weight and bias
  parameters under the same names, so the state dict is that of the plain model.
  Under FSDP with several data-parallel ranks the weights are all-gathered in
  float8 (half of bf16's bytes), with their scales computed once per step for all
  layers after the optimizer step (`precompute_scales_after_steps`).

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
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, say, spell
from scaletrain.strategies.blocks import auto_wrap_targets

__all__ = [
    "AC_MODES",
    "FLOAT8_GPUS",
    "FLOAT8_MIN_CAPABILITY",
    "apply_levers",
    "check_compiler",
    "check_float8",
    "check_levers",
    "compile_backend",
    "convert_float8",
    "float8_layers",
    "float8_note",
    "lever_blocks",
    "plain_tensor",
    "precompute_scales_after_steps",
    "selective_keeps",
    "selective_policy",
]

AC_MODES = ("none", "full", "selective")
"""Activation checkpointing modes: none, full (every block), selective."""

_MARK = "_scaletrain_levers"
_FLOAT8_MARK = "_scaletrain_float8"

FLOAT8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which GPUs multiply float8 matrices (Ada, Hopper, Blackwell)."""

FLOAT8_GPUS = "L4, L40S, RTX 4090, H100, H200, B200"
"""GPUs with float8 matrix multiplication, named in the refusals."""

_FLOAT8_DIVISOR = 16
"""Float8 matmuls need both matrix dimensions a layer contributes divisible by 16."""

_float8_on_any_device = False
"""Test hook, never set by scaletrain: True lets float8 run on a device without float8
matmuls (the CPU), with torchao's emulation (float8 casts and scales as on a GPU, the
matmul of the dequantised values in high precision), so the tests can check the
plumbing (conversion, names, FSDP's float8 all-gather, tensor parallel's float8
styles) without a GPU. The device refusal itself is unchanged for everyone else."""


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


_BLOCKS = (
    "A block is a module of its own with layers inside, kept with its likes in an "
    "nn.ModuleList or nn.Sequential (a transformer's layers); bare layers (Linear, Conv2d) "
    "in a container are not blocks."
)


def lever_blocks(
    model: nn.Module, ac: str, blocks: Sequence[str] | None = None, owner: str = "strategy"
) -> list[str]:
    """The blocks the levers act on (default: auto_wrap_targets); ConfigError when
    checkpointing is asked of a model that has none. Works on the meta device, so a
    launcher refuses such a model before any process starts."""
    names = list(auto_wrap_targets(model) if blocks is None else blocks)
    if ac != "none" and not names:
        raise ConfigError(
            f"{say(api=f'{owner}: ', cli='')}{spell('ac', ac)} checkpoints a model's "
            f"repeated blocks, and this {type(model).__name__} has none. {_BLOCKS} Fix: "
            f"group its layers into such blocks, or train with {spell('ac', 'none')}.",
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
) -> list[str]:
    """Checkpoint and/or compile `model`'s blocks in place; returns the blocks acted on.

    `blocks` are qualified module names (default: auto_wrap_targets). Applying the
    levers twice to one model is refused: a block checkpointed twice would recompute
    twice.
    """
    if ac == "none" and not compile:
        return []
    check_levers(owner, ac, ac_every, compile)
    if getattr(model, _MARK, None) is not None:
        raise ConfigError(
            f"{owner}: this {type(model).__name__} already had activation checkpointing or "
            "compile applied; set them once, on the strategy that sets the model up."
        )
    names = lever_blocks(model, ac, blocks, owner)
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


# -- float8 ---------------------------------------------------------------------


def _has_float8(device: torch.device) -> tuple[bool, str]:
    """Whether `device` multiplies float8 matrices, and what it is in words."""
    if device.type != "cuda":
        return False, "the CPU" if device.type == "cpu" else f"a {device.type} device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if torch.version.hip is not None:
        # AMD: float8 matmuls from the MI300 (gfx942) on.
        arch = str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", ""))
        return arch.startswith(("gfx942", "gfx95")), f"{device} ({name}, {arch or 'unknown'})"
    capability = torch.cuda.get_device_capability(index)
    what = f"{device} ({name}) of compute capability {capability[0]}.{capability[1]}"
    return capability >= FLOAT8_MIN_CAPABILITY, what


def check_float8(device: torch.device, owner: str = "strategy") -> None:
    """Refuse float8 where it cannot run, before anything starts: without torchao
    (an optional extra), or on a device without float8 matmuls."""
    where = say(api=f"{owner}: ", cli="")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"{where}{spell('float8', True)} uses torchao's float8 layers, and torchao is not "
            "installed. Fix: pip install 'scaletrain[float8]'.",
            field="float8",
        )
    if _float8_on_any_device:
        return
    ok, what = _has_float8(device)
    if not ok:
        major, minor = FLOAT8_MIN_CAPABILITY
        raise ConfigError(
            f"{where}{spell('float8', True)} needs GPUs that multiply float8 matrices (NVIDIA "
            f"compute capability {major}.{minor} or newer: {FLOAT8_GPUS}), and this run's "
            f"device is {what}. Fix: train without {spell('float8')} here (bf16-mixed "
            "precision is the fast choice), or on one of those GPUs.",
            field="float8",
        )


def float8_note(compile: bool | str) -> str | None:
    """The one line to show when float8 runs without compile; None when compiled."""
    if compile:
        return None
    return (
        f"{spell('float8', True)} without {spell('compile', True)}: float8 is fast only "
        "compiled (eager, its casts and scales are separate kernels that cost more than the "
        f"faster matmuls save); add {spell('compile', True)}."
    )


def _float8_eligible(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and module.in_features % _FLOAT8_DIVISOR == 0
        and module.out_features % _FLOAT8_DIVISOR == 0
    )


def float8_layers(
    model: nn.Module, blocks: Sequence[str] | None = None, owner: str = "strategy"
) -> list[str]:
    """The Linear layers float8 converts: those inside the blocks (default:
    auto_wrap_targets) whose widths are multiples of 16. ConfigError when there are
    none. Works on the meta device, so a launcher refuses before any process starts."""
    names = list(auto_wrap_targets(model) if blocks is None else blocks)
    where = say(api=f"{owner}: ", cli="")
    if not names:
        raise ConfigError(
            f"{where}{spell('float8', True)} converts the Linear layers of a model's repeated "
            f"blocks, and this {type(model).__name__} has none. {_BLOCKS} Fix: group its "
            f"layers into such blocks, or train without {spell('float8')}.",
            field="float8",
        )
    prefixes = tuple(f"{n}." for n in names if n)
    layers = [
        name
        for name, module in model.named_modules()
        if (not prefixes or name.startswith(prefixes)) and _float8_eligible(module)
    ]
    if not layers:
        raise ConfigError(
            f"{where}{spell('float8', True)}: no Linear layer in the blocks of this "
            f"{type(model).__name__} has input and output widths divisible by "
            f"{_FLOAT8_DIVISOR}, which float8 matmuls need. Fix: widths such as multiples of "
            f"{_FLOAT8_DIVISOR}, or train without {spell('float8')}.",
            field="float8",
        )
    return layers


def convert_float8(
    model: nn.Module,
    blocks: Sequence[str] | None = None,
    *,
    fsdp_all_gather: bool = False,
    owner: str = "strategy",
) -> list[str]:
    """Swap the Linear layers of `model`'s blocks for torchao's Float8Linear, in place
    (same names, same weight and bias parameters, so the state dict is unchanged);
    returns the layers converted. `fsdp_all_gather`: wrap the weights for FSDP's
    float8 all-gather (new Parameter objects: FSDP's setup rebinds the optimizer).
    Call it on the model's final device, before tensor parallel, checkpointing,
    compile and FSDP (see the module docstring)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if getattr(model, _FLOAT8_MARK, None) is not None:
        raise ConfigError(
            f"{owner}: this {type(model).__name__} already had float8 applied; set float8 "
            "once, on the strategy that sets the model up."
        )
    layers = set(float8_layers(model, blocks, owner))
    config = Float8LinearConfig(
        enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=_float8_on_any_device
    )
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in layers
    )
    object.__setattr__(model, _FLOAT8_MARK, "fsdp-all-gather" if fsdp_all_gather else "local")
    return sorted(layers)


def precompute_scales_after_steps(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """With FSDP's float8 all-gather, compute every float8 weight's scale in one
    all-reduce after each optimizer step (torchao's precompute_float8_dynamic_scale_for_fsdp),
    rather than one per layer inside the next forward. An optimizer step post-hook, so a
    loop of the user's own gets it too. Does nothing for a model without that all-gather."""
    if getattr(model, _FLOAT8_MARK, None) != "fsdp-all-gather":
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    optimizer.register_step_post_hook(after_step)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass (float8's weights under FSDP's float8
    all-gather are one, holding the weight itself): what a state dict hands out, so a
    model without float8 (and torch.load's weights_only) takes it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t) and type(t).__name__ != "DTensor":
        inner, _ = t.__tensor_flatten__()
        if len(inner) != 1:
            break
        t = getattr(t, inner[0])
    return t
