"""Batches as the pipeline sees them: their size, trace signature, device and padding."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from scaletrain.errors import ConfigError

__all__ = ["batch_size", "pad", "to_device", "trailing"]


def batch_size(inputs: Any) -> int:
    """The batch dimension (dim 0) shared by every tensor in `inputs`."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if not leaves or any(t.dim() == 0 for t in leaves):
        raise ConfigError(
            f"the pipeline cuts inputs into microbatches along dim 0, but got "
            f"{type(inputs).__name__} with no batched tensor. Pass a tensor (or a tuple of "
            "tensors) whose first dimension is the batch."
        )
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise ConfigError(f"pipeline inputs disagree on the batch size (dim 0): {sorted(sizes)}.")
    return int(leaves[0].shape[0])


def trailing(inputs: Any) -> tuple[Any, ...]:
    """Everything about the inputs a trace depends on, but the batch size."""
    leaves, spec = pytree.tree_flatten(inputs)
    return (
        str(spec),
        tuple(
            (tuple(t.shape[1:]), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
            for t in leaves
        ),
    )


def to_device(inputs: Any, device: torch.device) -> Any:
    """`inputs` with every tensor in it moved to `device`."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def pad(inputs: Any, size: int) -> Any:
    """Repeat the last sample up to `size` rows (valid values for any input: token ids too)."""

    def pad_leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.shape[0] == size:
            return t
        extra = t[-1:].expand(size - t.shape[0], *t.shape[1:])
        return torch.cat([t, extra])

    return pytree.tree_map(pad_leaf, inputs)
