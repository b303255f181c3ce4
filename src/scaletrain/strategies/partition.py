"""Balancing a model's layers over N contiguous parts by parameter count.

One rule for every strategy that cuts a model into consecutive parts: pipeline
stages (`Pipeline(stages=N)`) and the devices of `device_map="auto"`.

Layers are the model's top-level children in registration order, with every
container among them opened into its entries, at any depth: a ModuleList or
ModuleDict (never called itself) and an nn.Sequential (which calls its entries in
order, one's output the next one's input, so a cut between two of them is a valid
boundary). A subclass of nn.Sequential with its own forward, or any other module,
is not opened: its forward may do anything between its children. A model that is
one child wrapping everything is opened too (else there would be a single layer).
A child without parameters (dropout, an activation) joins the layer before it, so
no part begins with one; those before the first layer join the first. A parameter
shared by two layers is counted once, in the first.

The parts are contiguous and the largest is as small as it can be; among cuts
with that largest part, the most even one (least sum of squared sizes) wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from torch import nn

from scaletrain.errors import ConfigError

__all__ = ["Layer", "balance_stages", "list_layers", "list_units", "shared_between", "split_layers"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Containers that are never called: the parent's forward calls their entries."""


@dataclass(frozen=True, slots=True)
class Layer:
    """One part a model may be cut before, with the parameter-free modules around it."""

    name: str
    """Qualified name of the module holding the layer's parameters: where a part begins."""
    members: tuple[str, ...]
    """Every module of the layer, in registration order (`name` and those joining it)."""
    size: int
    """Parameters of the layer (shared ones counted in the first layer using them)."""


def list_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a model may be cut between, with or without parameters, in order.

    Containers are opened into their entries at any depth (module docstring): GPT's
    `blocks.0`, `blocks.1`, ...; `trunk.0`, `trunk.1`, ... for blocks in a nested
    nn.Sequential. A model that is one child wrapping everything is opened too. A
    model without children has no units.
    """
    units: list[tuple[str, nn.Module]] = [("", model)]
    while len(units) == 1:
        entries = _entries(*units[0])
        if not entries:
            break
        units = entries
    return [u for u in units if u[0]]


def _opens(module: nn.Module) -> bool:
    """A container whose entries are the units: never called, or called in order."""
    if isinstance(module, _CONTAINERS):
        return True
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _entries(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`module`'s children by qualified name, each container among them opened."""
    entries: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if _opens(child):
            entries.extend(_entries(qualified, child))
        else:
            entries.append((qualified, child))
    return entries


def list_layers(model: nn.Module) -> list[Layer]:
    """The model's layers (module docstring); empty when no unit holds parameters."""
    seen: set[int] = set()
    leading: list[str] = []
    layers: list[tuple[str, list[str], int]] = []
    for name, unit in list_units(model):
        size = 0
        held = False
        for p in unit.parameters():
            held = True
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel()
        if held:
            layers.append((name, [*leading, name], size))
            leading = []
        elif layers:
            layers[-1][1].append(name)
        else:
            leading.append(name)
    return [Layer(name=n, members=tuple(m), size=s) for n, m, s in layers]


def balance_stages(sizes: Sequence[int], n: int) -> list[int]:
    """Indices where parts 1..n-1 begin: contiguous, the largest part as small as it can be.

    Ties (several cuts with the same largest part) go to the most even one (least
    sum of squared part sizes).
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
    # best[s][j]: smallest possible largest part cutting the first j layers into s parts.
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for s in range(1, n + 1):
        for j in range(s, k + 1):
            best[s][j] = min(max(best[s - 1][i], total(i, j)) for i in range(s - 1, j))
    limit = best[n][k]
    # Among cuts within `limit`, the least sum of squares; remember where each part began.
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


def split_layers(layers: Sequence[Layer], parts: int) -> list[list[Layer]]:
    """`layers` cut into `parts` balanced contiguous parts (at most one per layer)."""
    if parts < 1:
        raise ConfigError(f"cannot split a model into {parts} part(s); expected at least 1.")
    if not layers:
        return []
    n = min(parts, len(layers))
    bounds = [0, *balance_stages([layer.size for layer in layers], n), len(layers)]
    return [list(layers[a:b]) for a, b in pairwise(bounds)]


def shared_between(model: nn.Module, parts: Sequence[Sequence[Layer]]) -> list[str]:
    """Names of the parameters modules of more than one part use: tied weights (a
    language model's embedding and head), which parts on different devices would each
    hold a copy of."""
    modules, seen = dict(model.named_modules()), dict[int, set[int]]()
    names = {id(p): n for n, p in model.named_parameters()}
    for i, part in enumerate(parts):
        for p in {id(p) for x in part for m in x.members for p in modules[m].parameters()}:
            seen.setdefault(p, set()).add(i)
    return sorted(names[p] for p, where in seen.items() if len(where) > 1)
