"""The rows rt.gather and rt.gather_for_metrics send: the tensors of a structure (a
tensor, or a dict, list or tuple of them) taken out and put back in order, and a
tensor's rows less those of the samples a loader added as padding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from scaletrain.data import ShardedLoader
from scaletrain.errors import article

__all__ = ["real_rows", "rebuild", "tensors"]


def tensors(data: Any, name: str) -> tuple[list[torch.Tensor], str | None]:
    """The tensors in `data` (a tensor, or a dict/list/tuple of them, nested), in order;
    or the problem, in the words of `name`, if something else is in it."""
    leaves: list[torch.Tensor] = []

    def walk(item: Any, path: str) -> str | None:
        if isinstance(item, torch.Tensor):
            leaves.append(item)
            return None
        if isinstance(item, Mapping):
            children = [(f"{path}[{k!r}]", v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(item)]
        else:
            where = f"data{path}" if path else "data"
            return (
                f"{name}(data): {where} is {article(type(item).__name__)}; expected a tensor, or a "
                "dict, list or tuple of tensors. Fix: torch.tensor(x) for numbers (or "
                "rt.reduce to sum them); rt.broadcast_object for other objects."
            )
        for child_path, child in children:
            problem = walk(child, child_path)
            if problem is not None:
                return problem
        return None

    problem = walk(data, "")
    return (leaves, None) if problem is None else ([], problem)


def rebuild(data: Any, leaves: list[torch.Tensor]) -> Any:
    """`data` with its tensors replaced by `leaves`, in the order `tensors` found them."""
    it = iter(leaves)

    def build(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return next(it)
        if isinstance(item, Mapping):
            return {k: build(v) for k, v in item.items()}
        if isinstance(item, tuple) and hasattr(item, "_fields"):
            return type(item)(*(build(v) for v in item))  # a namedtuple
        if isinstance(item, (list, tuple)):
            return type(item)(build(v) for v in item)
        return item

    return build(data)


def real_rows(tensor: torch.Tensor, loader: ShardedLoader, name: str) -> torch.Tensor:
    """`tensor`'s rows less those of the samples the loader added as padding."""
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    padding = loader.padding(rows.shape[0], caller=name)
    if not bool(padding.any()):
        return rows
    keep = (~padding).nonzero().squeeze(1).to(rows.device)
    return rows.index_select(0, keep)
