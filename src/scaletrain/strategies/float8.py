"""float8 training, one of the levers (scaletrain.strategies.levers says in which order
the strategies apply them, and why).

float8 training (`float8`) swaps the nn.Linear layers inside the blocks for
torchao's Float8Linear, whose matrix multiplications take float8 inputs scaled
per tensor (torch._scaled_mm on GPUs of compute capability 8.9 and newer). The
embeddings, the output head and anything else outside the blocks stay in high
precision, as do layers whose input or output width is not a multiple of 16 (the
float8 kernels' rule). Float8Linear keeps the layer's own weight and bias
parameters under the same names, so the state dict is that of the plain model.
Under FSDP with several data-parallel ranks the weights are all-gathered in
float8 (half of bf16's bytes), with their scales computed once per step for all
layers after the optimizer step (`precompute_scales_after_steps`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from scaletrain._lazy import import_quietly
from scaletrain.errors import ConfigError, say, spell
from scaletrain.strategies.blocks import _BLOCKS, auto_wrap_targets

__all__ = [
    "FLOAT8_GPUS",
    "FLOAT8_MIN_CAPABILITY",
    "check_float8",
    "convert_float8",
    "float8_layers",
    "float8_note",
    "plain_tensor",
    "precompute_scales_after_steps",
    "require_torchao",
]

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
    require_torchao(owner)
    where = say(api=f"{owner}: ", cli="")
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


def require_torchao(owner: str = "strategy") -> None:
    """Refuse float8 without torchao, the optional extra whose layers it uses."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"{say(api=f'{owner}: ', cli='')}{spell('float8', True)} uses torchao's float8 "
            "layers, and torchao is not installed. Fix: pip install 'scaletrain[float8]'.",
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
    model: nn.Module,
    blocks: Sequence[str] | None = None,
    owner: str = "strategy",
    doing: str = "train",
) -> list[str]:
    """The Linear layers float8 converts: those inside the blocks (default:
    auto_wrap_targets) whose widths are multiples of 16. ConfigError when there are
    none, whose fix says to `doing` ("train", "plan") without float8. Works on the meta
    device, so a launcher refuses before any process starts."""
    names = list(auto_wrap_targets(model) if blocks is None else blocks)
    where = say(api=f"{owner}: ", cli="")
    if not names:
        raise ConfigError(
            f"{where}{spell('float8', True)} converts the Linear layers of a model's repeated "
            f"blocks, and this {type(model).__name__} has none. {_BLOCKS} Fix: group its "
            f"layers into such blocks, or {doing} without {spell('float8')}.",
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
            f"{_FLOAT8_DIVISOR}, or {doing} without {spell('float8')}.",
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
    import_quietly("torchao.float8")
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
