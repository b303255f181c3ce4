"""The gradient norm of the whole model, however its gradients are spread over ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["clip_grads_", "global_grad_norm"]


def _placement_key(t: torch.Tensor) -> Any:
    spec = getattr(t, "_spec", None)
    if spec is None:
        return None
    return (id(spec.mesh), tuple(str(p) for p in spec.placements))


def global_grad_norm(
    grads: Sequence[torch.Tensor | None],
    norm_type: float = 2.0,
    *,
    group: Any = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The norm a single process holding the whole model would compute.

    - DTensor gradients (FSDP shards, tensor-parallel shards) are grouped by mesh and
      placement; each group's norm is taken as a DTensor, whose `full_tensor()`
      combines the shards (one collective per group, not per parameter).
    - Plain gradients are either replicas on every rank (DDP, replicated layers under
      tensor parallel): their local norm is already the global one; or different
      parameters on different ranks (pipeline stages): pass that `group` and the
      partial norms are summed (max for inf) across it.
    Returns a float32 scalar on `device` (the same value on every rank).
    """
    p = float(norm_type)
    out_device = device or torch.device("cpu")
    plain: list[torch.Tensor] = []
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        if g is None:
            continue
        key = _placement_key(g)
        if key is None:
            plain.append(g)
        else:
            groups.setdefault(key, []).append(g)
    partial: list[torch.Tensor] = []
    for members in groups.values():
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, p) for g in members]), p
        )
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        partial.append(full.to(out_device, torch.float32))
    local = torch.zeros((), device=out_device, dtype=torch.float32)
    if plain:
        local = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float(), p).to(out_device) for g in plain]), p
        )
    if group is not None and dist.is_available() and dist.is_initialized():
        if math.isinf(p):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        else:
            powered = local**p
            dist.all_reduce(powered, group=group)
            local = powered ** (1.0 / p)
    parts = [local, *partial]
    if math.isinf(p):
        return torch.stack(parts).max()
    return torch.linalg.vector_norm(torch.stack(parts), p)


def clip_grads_(grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` in place so that a whole-model norm of `total` becomes <= max_norm."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        # A DTensor gradient cannot take a plain tensor factor: its Python value then.
        is_dtensor = type(grad).__name__ == "DTensor"
        grad.mul_(coef.item() if is_dtensor else coef.to(grad.device, grad.dtype))
