"""What a step's kernels ask of a device, counted as they run under fake tensors
(profile.py's profile runs the step inside these dispatch modes).

- `Kernels` counts the kernels a phase launches and the bytes the memory-bound ones
  move (a matrix product's time is its FLOPs, counted by the ledger's counter), the
  ops on whole weights apart (`Work`, `fixed`), float8 training's casts and matmuls,
  and the matmuls autocast leaves in float32.
- `GroupedMm` gives torch._grouped_mm's fake output where torch's own fake kernel
  refuses it (float32 and float16).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.observe.metrics.flops import grouped_mm_flops

__all__ = ["GroupedMm", "Kernels", "Work", "nbytes"]


@dataclass(frozen=True, slots=True)
class Work:
    """What a phase of a step asks of a device: matmul FLOPs, bytes other kernels move,
    and kernels launched."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0
    fp8: float = 0.0
    """Of `flops`, those of float8 matmuls (float8 training's layers)."""
    casts: float = 0.0
    """Of `bytes`, those float8 training's casts move (eager: amax, scale, clamp and
    the float8 copy, each a kernel of its own)."""
    fused: float = 0.0
    """What those casts move compiled: the amax reads the tensor, one kernel reads it
    again and writes its float8 copy."""
    fp32: float = 0.0
    """Of `flops`, those of matmuls in float32 where the step computes in a lower dtype
    (torch._grouped_mm under autocast, which does not cast it: transformers casts a
    mixture of experts' input to the float32 weights)."""

    def __add__(self, o: Work) -> Work:
        return Work(self.flops + o.flops, self.bytes + o.bytes, self.kernels + o.kernels,
                    self.fp8 + o.fp8, self.casts + o.casts, self.fused + o.fused,
                    self.fp32 + o.fp32)  # fmt: skip

    def scaled(self, by: float, kernels: float = 1.0) -> Work:
        return Work(self.flops * by, self.bytes * by, round(self.kernels * kernels),
                    self.fp8 * by, self.casts * by, self.fused * by, self.fp32 * by)  # fmt: skip


def nbytes(value: Any) -> int:
    """Bytes of the tensors in `value` (a tensor, or a sequence or mapping of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    return 0


class Kernels(TorchDispatchMode):
    """Counts kernels, and the bytes moved by those that are not matrix products; those
    on whole weights (a parameter's cast for autocast, its gradient's cast back: an
    op with a parameter among its inputs, or a copy shaped as one, or as one
    transposed) apart, in `fixed`: they cost the same at any batch."""

    def __init__(
        self,
        shapes: Collection[tuple[int, ...]] = (),
        casting: Callable[[], bool] = lambda: False,
        cast_from: tuple[int, int] = (2, 2),
        low: bool = False,
    ) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._matmuls = {**flop_registry, torch.ops.aten._grouped_mm: grouped_mm_flops}
        self._shapes = shapes
        self._casting, self._from = casting, cast_from
        self._low = low  # the step computes in a 2-byte dtype (Work.fp32)
        self.work = Work()
        self.fixed = Work()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        written, op = nbytes(out), func.overloadpacket
        if not written or getattr(func, "is_view", False) or op in _FREE:
            return out  # metadata (prim.device, sizes), views and bare allocations
        moved = Work(0.0, 0.0 if op in self._matmuls else nbytes(args) + written, 1)
        if op is torch.ops.aten._grouped_mm and args[0].dtype != torch.bfloat16:
            # torch 2.13's CUDA kernel runs it outside bfloat16 as one matmul per group
            # (one batched matmul where no offsets split it); autocast does not cast it,
            # so under a mixed precision it runs in float32 (Work.fp32).
            offs = args[2] if len(args) > 2 else None
            moved = replace(moved, kernels=1 if offs is None else offs.shape[0])
            if self._low and out.dtype == torch.float32:
                moved = replace(moved, fp32=float(grouped_mm_flops(*args)))
        if op in self._matmuls and any(_is_float8(a) for a in args):
            # float8 training's matmul: torch._scaled_mm runs inside the tensor subclass,
            # below this mode, which sees an aten.mm of float8 tensors.
            moved = replace(
                moved, fp8=float(self._matmuls[op](*args, **(kwargs or {}), out_val=out))
            )
        elif op in _CASTS and self._casting():  # a float8 layer's scale and cast
            moved = replace(moved, casts=moved.bytes, fused=self._fused(out))
        if any(isinstance(a, nn.Parameter) for a in args) or (
            op is torch.ops.aten._to_copy and self._shaped_as_weight(tuple(out.shape))
        ):
            self.fixed += moved
        else:
            self.work += moved
        return out

    def _shaped_as_weight(self, shape: tuple[int, ...]) -> bool:
        """A weight's shape, or a transposed weight's (`h @ emb.weight.t()`, a tied
        head: autocast casts the transposed view, and its gradient comes back so)."""
        return shape in self._shapes or shape[::-1] in self._shapes

    def _fused(self, out: Any) -> float:
        """What a float8 cast moves compiled, counted at its float8 output: a read of the
        source for its scale (amax), a read and the one-byte write (a weight's source in
        the weights' dtype, anything else in the activations')."""
        if getattr(out, "dtype", None) not in _FLOAT8:
            return 0.0
        shape = tuple(out.shape)
        weight = self._shaped_as_weight(shape)
        return float(out.numel() * (1 + 2 * self._from[0 if weight else 1]))


class GroupedMm(TorchDispatchMode):
    """torch._grouped_mm (a mixture of experts' matmuls, as transformers runs them)
    under fake tensors as its kernels run it: torch 2.13's fake kernel takes bfloat16
    alone, where its CPU and CUDA kernels take float16 and float32 too (a model at
    precision 32, or under autocast, which does not cast this op). The output:
    `mat_a`'s rows by `mat_b`'s columns in their dtype, one matrix per group where two
    2-D operands split their shared dimension. Beneath the profile's counters, which
    see the op itself."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not _GROUPED_MM or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        a, b = args[0].shape, args[1].shape
        rows = tuple(a[:-1]) if len(b) == 3 else (a[-2],)  # a 3-D mat_b: one per group
        # Two 2-D operands: one output per offset (the dispatcher passes it by position).
        groups = (args[2].shape[0],) if len(a) == len(b) == 2 else ()
        shape = (*groups, *rows, b[-1])
        # The kernels take no out_dtype but mat_a's.
        return torch.empty(shape, dtype=args[0].dtype, device=args[0].device)


_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _is_float8(value: Any) -> bool:
    """A float8 tensor, or float8 training's subclass holding one (its `_data`)."""
    dtypes = (getattr(value, "dtype", None), getattr(getattr(value, "_data", None), "dtype", None))
    return any(d in _FLOAT8 for d in dtypes)


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}

_CASTS = {torch.ops.aten.abs, torch.ops.aten.amax, torch.ops.aten.max, torch.ops.aten.clamp,
          torch.ops.aten.clamp_min, torch.ops.aten.clamp_max, torch.ops.aten.mul,
          torch.ops.aten.div, torch.ops.aten.reciprocal, torch.ops.aten._to_copy,
          torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten.maximum,
          torch.ops.aten.minimum}  # fmt: skip
"""The ops of a float8 cast (the absolute maximum, the scale, the clamp, the float8
copy, a transposed copy): inside a float8 layer, what is not its matmul, its bias or
its gradients' sums."""

_FREE = {torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten.empty,
         torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.alias,
         torch.ops.aten._unsafe_view}  # fmt: skip
"""Ops that allocate or relabel without a kernel that moves data."""
