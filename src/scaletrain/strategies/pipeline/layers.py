"""Which layers a pipeline may cut between, and where to cut for balanced stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["balance_stages", "pipeline_layers"]


def pipeline_layers(model: nn.Module) -> list[tuple[str, int]]:
    """(first module name, parameter count) of each layer the balancer may cut between.

    Layers are the model's top-level children in order, ModuleList/ModuleDict entries
    counted one by one; a child without parameters (dropout, activation) joins the
    layer before it, so no stage begins with one.
    """
    entries: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            entries.extend((f"{name}.{sub}", m) for sub, m in child.named_children())
        else:
            entries.append((name, child))
    seen: set[int] = set()
    layers: list[list[Any]] = []
    leading = 0
    for name, child in entries:
        size = 0
        for p in child.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel()
        has_params = any(True for _ in child.parameters())
        if has_params:
            layers.append([name, size])
        elif layers:
            layers[-1][1] += size
        else:
            leading += size
    if layers:
        layers[0][1] += leading
    return [(str(n), int(s)) for n, s in layers]


def balance_stages(sizes: Sequence[int], n: int) -> list[int]:
    """Indices where stages 1..n-1 begin: contiguous, the largest stage as small as it can be.

    Ties (several cuts with the same largest stage) go to the most even one (least
    sum of squared stage sizes).
    """
    k = len(sizes)
    if not 1 <= n <= k:
        raise ValueError(f"cannot cut {k} layer(s) into {n} non-empty stage(s)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def total(i: int, j: int) -> int:
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[s][j]: smallest possible largest stage cutting the first j layers into s stages.
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for s in range(1, n + 1):
        for j in range(s, k + 1):
            best[s][j] = min(max(best[s - 1][i], total(i, j)) for i in range(s - 1, j))
    limit = best[n][k]
    # Among cuts within `limit`, the least sum of squares; remember where each stage began.
    sq = [[inf] * (k + 1) for _ in range(n + 1)]
    start = [[0] * (k + 1) for _ in range(n + 1)]
    sq[0][0] = 0
    for s in range(1, n + 1):
        for j in range(s, k + 1):
            for i in range(s - 1, j):
                if total(i, j) <= limit and sq[s - 1][i] + total(i, j) ** 2 < sq[s][j]:
                    sq[s][j] = sq[s - 1][i] + total(i, j) ** 2
                    start[s][j] = i
    cuts: list[int] = []
    j = k
    for s in range(n, 0, -1):
        j = start[s][j]
        cuts.append(j)
    return sorted(cuts)[1:]
