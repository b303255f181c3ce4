"""What a model costs, measured on the model itself: bytes, FLOPs and activations.

`profile_model` builds the model twice without real memory: on the meta device for
the parameter and buffer sizes, and under a FakeTensorMode for one forward/backward
and one optimizer step at the real batch shape. Under the fake mode:

- FLOPs come from torch.utils.flop_counter.FlopCounterMode, per module.
- Memory comes from torch.distributed._tools.mem_tracker.MemTracker, PyTorch's own
  tracker for exactly this (it works with fake tensors on any device, CPU included):
  the step's peak split into parameters, gradients, activations and temporaries, and
  per module the bytes a forward leaves alive (what pipeline stages and tensor
  parallel split).
- The optimizer state is what one fake `optimizer.step()` allocates (Adam: two
  tensors per parameter, SGD with momentum: one).

torch.distributed._tools.runtime_estimator.RuntimeEstimator is NOT used for time: its
"roofline" mode asks the CUDA device for its peak FLOP/s and bandwidth, and its
"operator-level-benchmark" mode runs every op on a real CUDA device, so on a CPU (or
for a GPU that is not here) it has nothing to say. Time comes instead from these FLOPs
and a measured (or datasheet) throughput: see scaletrain.plan.estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModelProfile", "ModuleCost", "profile_model"]


@dataclass(frozen=True, slots=True)
class ModuleCost:
    """One module's share of a training step (forward and backward)."""

    name: str
    param_bytes: int
    flops: int
    """Forward and backward FLOPs spent inside the module (its children included)."""
    activation_bytes: int
    """Bytes the module's forward leaves alive for the backward."""
    input_bytes: int
    output_bytes: int
    buffer_bytes: int = 0
    """Its buffers' bytes (BatchNorm's running statistics), its children's included."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One training step of a model at one batch, measured without real memory."""

    model: str
    batch_size: int
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    """Gradients of every trainable parameter."""
    peak_grad_bytes: int
    """Gradients alive at the forward/backward's peak (the backward frees activations
    as it makes gradients, so the peak seldom holds them all)."""
    optimizer_bytes: int
    activation_bytes: int
    """Peak bytes the forward/backward holds beyond parameters, buffers and gradients
    (saved activations and temporaries at the worst moment)."""
    flops: int
    """Forward + backward FLOPs of one step at `batch_size`."""
    modules: dict[str, ModuleCost] = field(default_factory=dict)
    """Every named module ("" is the model), in registration order."""

    def module(self, name: str) -> ModuleCost:
        return self.modules[name]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def _built(build: Callable[[], nn.Module], dtype: torch.dtype | None) -> nn.Module:
    """`build()`, its floating parameters and buffers in `dtype` where given: built
    under that default dtype, as `module.to(dtype)` cannot swap a fake tensor's
    parameters (RuntimeError under FakeTensorMode). Only the build: the forward keeps
    the default dtype, as in a run that converts a built model."""
    if dtype is None:
        return build()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(old)


def _meta_sizes(
    build: Callable[[], nn.Module], dtype: torch.dtype | None = None
) -> tuple[int, int]:
    with torch.device("meta"):
        model = _built(build, dtype)
    seen: set[int] = set()
    params = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params, buffers


def profile_model(
    build: Callable[[], nn.Module],
    example: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    autocast_dtype: torch.dtype | None = None,
    name: str | None = None,
    param_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Measure one training step of `build()` on `example` = (inputs, targets).

    `optimizer(params)` builds the optimizer; `autocast_dtype` runs the forward under
    torch.autocast (mixed precision); `param_dtype` holds the weights themselves (and
    the floating inputs) in that dtype (bf16-true). Nothing here allocates real tensor
    memory.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
    from torch.utils.flop_counter import FlopCounterMode

    param_bytes, buffer_bytes = _meta_sizes(build, param_dtype)
    inputs, targets = example
    if param_dtype is not None and inputs.is_floating_point():
        inputs = inputs.to(param_dtype)
    batch = int(inputs.shape[0])
    io: dict[str, list[int]] = {}

    def remember(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        io[names[id(module)]] = [_tensor_bytes(args), _tensor_bytes(out)]

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = _built(build, param_dtype)
        names = {id(m): n for n, m in model.named_modules()}
        handles = [m.register_forward_hook(remember) for m in model.modules()]
        opt = optimizer(model.parameters())
        x, y = mode.from_tensor(inputs), mode.from_tensor(targets)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        cast = (
            torch.autocast(device_type="cpu", dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with tracker, FlopCounterMode(display=False) as counter:
            with cast:
                loss = loss_fn(model(x), y)
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")
        opt.step()
        opt_bytes = sum(
            _tensor_bytes(t) for state in opt.state.values() for t in state.values() if t.dim()
        )
        for h in handles:
            h.remove()

    kinds = next(iter(peak.values())) if peak else {}
    grads = int(kinds.get(_MemRefType.GRAD, 0))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    act = int(kinds.get(_MemRefType.ACT, 0) + kinds.get(_MemRefType.TEMP, 0))
    counts = counter.get_flop_counts()
    root = type(model).__name__
    modules: dict[str, ModuleCost] = {}
    for qualified, module in model.named_modules():
        key = f"{root}.{qualified}" if qualified else root
        stats = tracker.memory_tracking.get(module)
        held = 0
        if stats is not None:
            pre = stats.snapshots.get(_ModState.PRE_FW, [])
            post = stats.snapshots.get(_ModState.POST_FW, [])
            if pre and post:
                held = max(
                    0, int(sum(post[0].get(d, {}).get(_MemRefType.ACT, 0) for d in post[0]))
                    - int(sum(pre[0].get(d, {}).get(_MemRefType.ACT, 0) for d in pre[0]))
                )  # fmt: skip
        in_b, out_b = io.get(qualified, [0, 0])
        modules[qualified] = ModuleCost(
            name=qualified,
            param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
            flops=int(sum(counts.get(key, {}).values())),
            activation_bytes=held,
            input_bytes=in_b,
            output_bytes=out_b,
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        )
    return ModelProfile(
        model=name or root,
        batch_size=batch,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=trainable,
        peak_grad_bytes=grads,
        optimizer_bytes=opt_bytes,
        activation_bytes=act,
        flops=int(counter.get_total_flops()),
        modules=modules,
    )
