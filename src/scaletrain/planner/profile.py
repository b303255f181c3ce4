"""What one training step of a model costs, measured without memory.

`profile_model` builds the model on the meta device (parameter sizes) and again under
a FakeTensorMode, where it runs one forward, backward and optimizer step at the real
batch shape with the levers applied as training applies them (activation
checkpointing's recomputation and smaller activations are measured, not modelled):

- FLOPs of the matrix products: the ledger's own counter
  (observe.metrics.flops.FlopCounter), so a plan's MFU and a run's count alike; per
  module, for tensor-parallel and pipeline splits.
- Every other kernel is memory-bound: the bytes it reads and writes, one launch each
  (kernels.py counts them).
- Memory (PyTorch's MemTracker): the peak split into gradients and activations (saved
  tensors and temporaries), what each module's forward leaves alive, and the optimizer
  step's temporaries and state.

Activations, FLOPs and elementwise bytes grow with the batch (every op of a step is
per sample or per token), so one profile prices any batch.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain._lazy import on_meta
from scaletrain.errors import ConfigError, say
from scaletrain.planner.kernels import GroupedMm, Kernels, Work, nbytes
from scaletrain.planner.refusals import quiet_meta_failures, refused
from scaletrain.precision import AUTOCAST_DTYPES

__all__ = ["ModelProfile", "ModuleCost", "profile_model"]


@dataclass(frozen=True, slots=True)
class ModuleCost:
    """One module's share of a step (forward and backward, its children included)."""

    param_bytes: int
    flops: int
    activation_bytes: int
    """Bytes its forward leaves alive for the backward."""
    output_bytes: int
    trainable_bytes: int = 0
    """Of `param_bytes`, those of parameters that require a gradient."""
    recomputed_bytes: int = 0
    """What its forward leaves alive when activation checkpointing runs it again in the
    backward, up to where the recomputation stops (selective checkpointing takes kept
    outputs from its cache). 0 where nothing recomputes it, and for a checkpointed block
    itself: the recomputation calls its forward, not the module, so only its children
    are seen."""
    recompute: int = 0
    """How far activation checkpointing's recomputation ran its forward: 0 not at all,
    1 into it (torch.utils.checkpoint stops once the backward has every tensor it
    saves, here inside this module), 2 through it (and through what follows it, such
    as tensor parallel's collective of its output). 0 for a checkpointed block itself,
    as above."""
    input: int = 0
    """Which tensor its forward took (numbered as the forward first met them; 0: none):
    the modules that took the same tensor object share a number, as an attention's q,
    k and v do (tensor parallel redistributes it once for them)."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One training step of a model at one batch (module docstring)."""

    model: str
    batch_size: int
    tokens: int
    """Samples times their sequence length (the batch for a model without one)."""
    params: int
    """Parameters (shared ones once)."""
    trainable: int
    """Of `params`, those that require a gradient (the rest are frozen: no gradient,
    no optimizer state)."""
    tensors: int
    """Parameter tensors the optimizer steps (a GPU's foreach optimizer launches per
    chunk of them)."""
    param_bytes: int
    trainable_bytes: int
    """Of `param_bytes`, those of the trainable parameters (a frozen base may be in
    another dtype than the layers trained on it)."""
    optimizer_bytes: int
    """The optimizer's state for every parameter (Adam: two tensors each)."""
    optimizer_temp_bytes: int
    """What the optimizer step allocates beyond its state, at its peak."""
    activation_bytes: int
    """Peak bytes the forward/backward holds beyond parameters, buffers and gradients."""
    peak_grad_bytes: int
    """Gradients alive at that peak (the backward frees activations as it makes them)."""
    head_activation_bytes: int
    """As `activation_bytes`, at the peak before the backward reaches the blocks (the
    forward's end, the loss, the head's backward): where a tensor-parallel rank peaks
    when the blocks' share, which it divides, is small beside the logits."""
    head_grad_bytes: int
    """Gradients alive at that peak (the head's)."""
    forward: Work
    backward: Work
    """Per-sample work (at `batch_size`), with any recomputation activation
    checkpointing adds."""
    fixed: Work
    """Forward and backward work of the ops with a weight among their inputs (autocast's
    casts of the parameters and of their gradients, a norm's scale): counted apart, at
    the profile's batch."""
    optimizer: Work
    ac: str = "none"
    modules: dict[str, ModuleCost] = field(default_factory=dict)
    recomputed_flops: float = 0.0
    """Of the backward's FLOPs, those of activation checkpointing's recomputation (at the
    profile's batch, as `backward`): time, but not the model's FLOPs an MFU counts."""

    @property
    def flops(self) -> float:
        return self.forward.flops + self.backward.flops

    @property
    def trained(self) -> float:
        """The share of the parameters that get a gradient."""
        return self.trainable / max(1, self.params)

    @property
    def model_flops(self) -> float:
        """The step's FLOPs without any recomputation: what MFU counts, as the ledger's."""
        return self.flops - self.recomputed_flops

    def per_sample(self, samples: float) -> float:
        """The factor from this profile's batch to `samples` per device."""
        return samples / self.batch_size


_INTERRUPTED: list[int] = []
"""A Ctrl-C that arrived during a profile, raised at the next block boundary."""


def _collect(*_: Any) -> None:
    gc.collect()
    if _INTERRUPTED:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _between_blocks() -> Any:
    """Python's cycle collector and Ctrl-C act only at block boundaries (`_collect`, a
    hook on each block's forward and backward). The collector frees what reference
    cycles hold (checkpointing's recomputations leave some) at the same points every
    call, as a run's would: left to its own times, the peak it measures moves between
    calls; paused, the garbage outgrows the activations. Each collection is a full one:
    a cycle may hold tensors from the forward until late in the backward (the root's
    forward frame, kept by an exception it caught), and a younger generation's would
    leave it counted. What the process held before the profile is frozen, out of the
    collector's walk (torch's own objects, the caller's: walking them was most of a
    small model's profile), unless the caller froze objects of its own: gc.unfreeze
    cannot tell those apart. A Ctrl-C raised inside torch's dispatch crosses C++ frames and aborts
    the process, so it waits for a boundary."""
    paused, main = gc.isenabled(), threading.current_thread() is threading.main_thread()
    previous: Any = False  # no handler installed (signal.signal may return None)
    freeze = gc.get_freeze_count() == 0
    try:
        gc.collect()
        gc.disable()
        if freeze:
            gc.freeze()
        if main:
            previous = signal.signal(signal.SIGINT, lambda *_: _INTERRUPTED.append(1))
        yield
    finally:
        if previous is not False:
            signal.signal(signal.SIGINT, previous)
        if freeze:
            gc.unfreeze()
        if paused:
            gc.enable()
        if main and _INTERRUPTED:
            _INTERRUPTED.clear()
            raise KeyboardInterrupt


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_untracked(tracker: Any, model: nn.Module) -> None:
    """Keep torch's MemTracker from hooking the gradients of frozen parameters: torch
    2.13's registers a gradient hook on every parameter of each module it enters, which
    raises for one that requires no gradient (a fine-tuned model's frozen layers). It
    skips a parameter whose hooks it holds, so each frozen one gets hooks that do
    nothing; it has no gradient to count."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def _built(build: Callable[[], nn.Module], dtype: torch.dtype | None) -> nn.Module:
    """build() with its floating parameters in `dtype` (built under that default
    dtype: module.to cannot swap a fake tensor's parameters)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or old)
    try:
        return build()
    finally:
        torch.set_default_dtype(old)


def _module_costs(
    model: nn.Module,
    tracker: Any,
    counts: Mapping[str, Mapping[Any, int]],
    io: Mapping[str, int],
    scale: float,
    through: Collection[str],
    took: Mapping[str, int],
) -> dict[str, ModuleCost]:
    """Each module's cost; `through`: the modules whose forward returned during the
    backward (the recomputation ran through them: the tracker's post-forward state is
    recorded even where the forward stopped inside)."""
    from torch.distributed._tools.mem_tracker import _MemRefType, _ModState

    root = type(model).__name__
    out: dict[str, ModuleCost] = {}

    def held(stats: Any, before: Any, after: Any) -> int:
        """Activations alive after a forward less those before it."""
        pre, post = (stats.snapshots.get(k) if stats else None for k in (before, after))
        if not (pre and post):
            return 0
        acts = [sum(s.get(d, {}).get(_MemRefType.ACT, 0) for d in s) for s in (pre[0], post[0])]
        return max(0, int(acts[1] - acts[0]))

    for name, module in model.named_modules():
        stats = tracker.memory_tracking.get(module)
        out[name] = ModuleCost(
            param_bytes=round(scale * sum(nbytes(p) for p in module.parameters())),
            trainable_bytes=round(
                scale * sum(nbytes(p) for p in module.parameters() if p.requires_grad)
            ),
            flops=int(sum(counts.get(f"{root}.{name}" if name else root, {}).values())),
            activation_bytes=held(stats, _ModState.PRE_FW, _ModState.POST_FW),
            output_bytes=io.get(name, 0),
            recomputed_bytes=held(stats, _ModState.PRE_FW_AC, _ModState.POST_FW_AC),
            recompute=2 if name in through
            else 1 if stats and stats.snapshots.get(_ModState.PRE_FW_AC) else 0,
            input=took.get(name, 0),
        )  # fmt: skip
    return out


def profile_model(
    build: Callable[[], nn.Module],
    example: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    precision: str = "32",
    ac: str = "none",
    ac_every: int | None = None,
    name: str | None = None,
    gathered: bool = False,
    float8: Sequence[str] | None = None,
) -> ModelProfile:
    """Measure one training step of `build()` on `example` = (inputs, targets) at
    `precision` ("32", "bf16-mixed", "fp16-mixed", "bf16-true") with activation
    checkpointing `ac`/`ac_every` as training applies it. Allocates no tensor memory.

    `gathered`: the step as sharded FSDP runs a mixed precision, its weights cast to
    the compute dtype as they are gathered and no autocast, so every activation (the
    norms' and the residual stream's too) is in the compute dtype. Sizes of the weights
    and of the optimizer's state and work stay the precision's (fp32 shards).

    `float8`: the blocks whose Linear layers float8 training converts, as training
    converts them (torchao's Float8Linear: the casts, scales and what its backward
    keeps are measured; its matmuls, torch._scaled_mm, are counted as `Work.fp8`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from scaletrain.observe.metrics.flops import FlopCounter
    from scaletrain.strategies.blocks import auto_wrap_targets
    from scaletrain.strategies.levers import apply_levers

    cast = AUTOCAST_DTYPES.get(precision)
    master = torch.bfloat16 if precision == "bf16-true" else None
    weights = cast if gathered and cast else master  # what the step's kernels read
    if gathered:
        cast = None  # FSDP's policy casts the weights; nothing autocasts
    inputs, targets = example
    if weights is not None and inputs.is_floating_point():
        inputs = inputs.to(weights)
    with on_meta():
        meta = _built(build, master)
    unique = {id(p): p for p in meta.parameters()}
    params = sum(p.numel() for p in unique.values())
    trained = [p.numel() for p in unique.values() if p.requires_grad]
    param_bytes = sum(nbytes(p) for p in unique.values())
    label = name or type(meta).__name__
    if not trained:
        raise ConfigError(
            f"{say(api='plan(...): ', cli='')}{label} has no parameter "
            "that requires a gradient: nothing to train, and a plan prices training. Fix: "
            "leave requires_grad=True on the parameters to train.",
            field="model",
        )
    del meta
    io: dict[str, int] = {}
    through: set[str] = set()  # forwards that returned in the backward (ModuleCost.recompute)
    backward: list[bool] = []

    def returned(m: nn.Module, _: Any, out: Any) -> None:
        io[names[id(m)]] = nbytes(out)
        if backward:
            through.add(names[id(m)])

    took: dict[str, int] = {}  # ModuleCost.input, by a weak reference to each tensor:
    met: dict[int, tuple[int, Any]] = {}  # holding it would move the tracked peak
    numbers = itertools.count(1)

    def taking(m: nn.Module, args: Any) -> None:
        if not args or not isinstance(x := args[0], torch.Tensor) or backward:
            return
        number, ref = met.get(id(x), (0, None))
        if ref is None or ref() is not x:  # new, or a new tensor at a freed one's id
            number, ref = next(numbers), weakref.ref(x)
            met[id(x)] = number, ref
        took[names[id(m)]] = number

    with (
        _between_blocks(),
        quiet_meta_failures(),
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        GroupedMm(),
    ):
        model = _built(build, weights)
        eight: list[str] = []
        if float8 is not None:  # first, as training applies the levers (strategies.levers)
            from scaletrain.strategies.float8 import convert_float8

            eight = convert_float8(model, float8, owner="plan(...)")
        root = type(model).__name__
        inside = {f"{root}.{n}" for n in eight}
        half = (torch.bfloat16, torch.float16)  # the weights' and the activations' bytes
        cast_from = (2 if weights in half else 4, 2 if (weights or cast) in half else 4)
        names = {id(m): n for n, m in model.named_modules()}
        # Weights, gradients and the optimizer's state and work at the meta model's size,
        # where the step reads weights of another dtype (`gathered`): 1 elsewhere.
        fake = sum(nbytes(p) for p in {id(p): p for p in model.parameters()}.values())
        scale = param_bytes / max(1, fake)
        hooks = [m.register_forward_hook(returned) for m in model.modules()]
        hooks += [m.register_forward_pre_hook(taking) for m in model.modules()]
        if ac != "none":
            apply_levers(model, ac=ac, ac_every=ac_every, owner="plan(...)", doing="plan")
        head: list[dict[Any, int]] = []  # the tracker's peak as the blocks' backward begins

        def reached(*_: Any) -> None:
            if not head:
                head.append(next(iter(tracker.get_tracker_snapshot("peak").values()), {}))

        for block in auto_wrap_targets(model):
            module = model.get_submodule(block)
            hooks.append(module.register_forward_hook(_collect))
            hooks.append(module.register_full_backward_pre_hook(_collect))
            hooks.append(module.register_full_backward_pre_hook(reached))
        opt = optimizer(model.parameters())
        x, y = mode.from_tensor(inputs), mode.from_tensor(targets)
        shapes = {tuple(p.shape) for p in model.parameters()}
        tracker = MemTracker()
        _frozen_untracked(tracker, model)
        tracker.track_external(model, opt)
        counter = FlopCounter()
        counter.start()
        try:
            with tracker:
                autocast = torch.autocast("cpu", dtype=cast) if cast else contextlib.nullcontext()
                casting = (
                    (lambda: not inside.isdisjoint(counter.running()))
                    if inside
                    else (lambda: False)
                )
                kernels = partial(Kernels, shapes, casting, cast_from, cast_from[1] == 2)
                with kernels() as fwd, autocast:
                    loss = loss_fn(model(x), y)
                flops_fwd = counter.count()
                backward.append(True)
                with kernels() as bwd, warnings.catch_warnings():
                    # The first block's input needs no gradient (it is the data): its
                    # backward pre-hook still fires, which is all the profile asks of it.
                    warnings.filterwarnings("ignore", "Full backward hook is firing")
                    loss.backward()
                flops_all = counter.count()
        except Exception as exc:
            if (refusal := refused(f"{label}'s step", exc, example)) is None:
                raise
            raise refusal from None
        finally:
            counter.stop()
        peak = tracker.get_tracker_snapshot("peak")
        modules = _module_costs(model, tracker, counter.by_module(), io, scale, through, took)
        met.clear()
        for h in hooks:
            h.remove()
        try:
            opt.step()  # the state exists from here on, as in every step after the first
            with MemTracker() as step_tracker, Kernels() as step:
                _frozen_untracked(step_tracker, model)
                step_tracker.track_external(model, opt)
                opt.step()
        except Exception as exc:
            if (refusal := refused(f"{label}'s optimizer", exc)) is None:
                raise
            raise refusal from None
        step_peak = step_tracker.get_tracker_snapshot("peak")
        state = sum(nbytes(t) for s in opt.state.values() for t in s.values() if t.dim())
    kinds = next(iter(peak.values())) if peak else {}
    step_kinds = next(iter(step_peak.values())) if step_peak else {}
    batch = int(inputs.shape[0])
    sequence = inputs.dim() == 2 and not inputs.is_floating_point()
    return ModelProfile(
        model=label, batch_size=batch,
        tokens=int(inputs.shape[0] * inputs.shape[1]) if sequence else batch,
        params=params, trainable=sum(trained), tensors=len(trained),
        param_bytes=param_bytes,
        trainable_bytes=sum(nbytes(p) for p in unique.values() if p.requires_grad),
        optimizer_bytes=round(state * scale),
        optimizer_temp_bytes=round(step_kinds.get(_MemRefType.TEMP, 0) * scale),
        activation_bytes=int(kinds.get(_MemRefType.ACT, 0) + kinds.get(_MemRefType.TEMP, 0)),
        head_activation_bytes=int(
            sum((head or [kinds])[0].get(k, 0) for k in (_MemRefType.ACT, _MemRefType.TEMP))
        ),
        head_grad_bytes=round((head or [kinds])[0].get(_MemRefType.GRAD, 0) * scale),
        peak_grad_bytes=round(kinds.get(_MemRefType.GRAD, 0) * scale),
        forward=replace(fwd.work, flops=float(flops_fwd), fp8=fwd.work.fp8 + fwd.fixed.fp8,
                        fp32=fwd.work.fp32 + fwd.fixed.fp32),
        backward=replace(
            bwd.work, flops=float(flops_all - flops_fwd), fp8=bwd.work.fp8 + bwd.fixed.fp8,
            fp32=bwd.work.fp32 + bwd.fixed.fp32,
        ),
        # Its matmuls' float8 and float32 FLOPs are counted in forward and backward.
        fixed=replace(fwd.fixed + bwd.fixed, fp8=0.0, fp32=0.0),
        optimizer=(step.work + step.fixed).scaled(scale),
        ac=ac if ac_every is None else f"{ac} every {ac_every}", modules=modules,
        recomputed_flops=float(counter.recomputed),
    )  # fmt: skip
