"""A model's blocks: the repeated modules FSDP shards as units, and the levers
(activation checkpointing, torch.compile) act on.

A transformer's blocks sit in a container (`blocks.0`, `blocks.1`, or Hugging
Face's `model.layers.0`...): found by walking down to the first container whose
elements hold parameters (see `auto_wrap_targets`), or named by class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from scaletrain.errors import ConfigError

__all__ = ["WrapSpec", "auto_wrap_targets", "normalise_wrap", "wrap_targets"]

WrapSpec = str | type[nn.Module] | Sequence[str | type[nn.Module]] | None
"""FSDP(wrap=...): "auto"/None, or module classes / class names (one or several)."""

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

_BLOCKS = (
    "A block is a module of its own with layers inside, kept with its likes in an "
    "nn.ModuleList or nn.Sequential (a transformer's layers); bare layers (Linear, Conv2d) "
    "in a container are not blocks."
)
"""What a block is, for the refusals of a model that has none (levers, float8)."""


def normalise_wrap(wrap: object) -> str | tuple[type[nn.Module] | str, ...]:
    if wrap is None or wrap == "auto":
        return "auto"
    items: Sequence[Any]
    if isinstance(wrap, (str, type)):
        items = (wrap,)
    elif isinstance(wrap, (tuple, list, set, frozenset)):
        items = tuple(wrap)
    else:
        items = ()
    ok = bool(items) and all(
        (isinstance(w, type) and issubclass(w, nn.Module)) or (isinstance(w, str) and w)
        for w in items
    )
    if not ok:
        raise ConfigError(
            f"FSDP(wrap={wrap!r}) is not a wrap policy; expected None or 'auto' (each "
            "block), or module classes / class names, e.g. wrap=(Block,) or "
            "wrap=('Block',)."
        )
    return tuple(items)


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_leaf_layer(module: nn.Module) -> bool:
    """A layer whose parameters are all its own (Linear, Conv2d, LayerNorm)."""
    return not any(_holds_parameters(child) for child in module.children())


def auto_wrap_targets(model: nn.Module) -> list[str]:
    """The modules `wrap="auto"` shards as their own units, by qualified name.

    Walking down from the root, at each container (ModuleList, Sequential,
    ModuleDict):

    - its elements that hold parameters are the units: a transformer's blocks
      (GPT's ``blocks.0``, ``blocks.1``), even when the root itself is the container;
    - unless every such element is a bare layer (Conv2d, BatchNorm, Linear: no
      sub-module with parameters): the container is then one stage and is the unit
      itself (ConvNet's ``layer1`` and ``layer2``), or, when it is the root, there
      are no units (the root is sharded anyway).

    Units are not searched further; modules outside containers are. A model with no
    containers has no units: it is sharded as one (the root).
    """
    targets: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, _CONTAINERS):
            members = [(n, c) for n, c in module.named_children() if _holds_parameters(c)]
            if members and all(_is_leaf_layer(c) for _, c in members):
                if prefix:
                    targets.append(prefix)
                return
            if members:
                targets.extend(f"{prefix}{'.' if prefix else ''}{n}" for n, _ in members)
                return
        for n, child in module.named_children():
            visit(f"{prefix}{'.' if prefix else ''}{n}", child)

    visit("", model)
    return targets


def wrap_targets(model: nn.Module, wrap: WrapSpec) -> list[str]:
    """Qualified names of the modules that become FSDP units, outermost first.

    `wrap` is "auto"/None (see `auto_wrap_targets`) or module classes / class names;
    a class matches the module's own class or a base class, a name the class's
    ``__name__``. The root is never a target (it is always sharded, last). Raises
    ConfigError for classes that match no module, listing the classes there are.
    """
    wrap = normalise_wrap(wrap)
    if wrap == "auto":
        return auto_wrap_targets(model)
    named = [(n, m) for n, m in model.named_modules() if n]
    targets: list[str] = []
    matched: set[int] = set()
    for name, mod in named:
        hits = [
            i
            for i, w in enumerate(wrap)
            if (isinstance(w, str) and type(mod).__name__ == w)
            or (isinstance(w, type) and isinstance(mod, w))
        ]
        if hits:
            targets.append(name)
            matched.update(hits)
    missing = [wrap[i] for i in range(len(wrap)) if i not in matched]
    if missing:
        shown = ", ".join(w if isinstance(w, str) else w.__name__ for w in missing)
        classes = sorted({type(m).__name__ for _, m in named})
        raise ConfigError(
            f"FSDP(wrap=...) names {shown}, but no sub-module of the "
            f"{type(model).__name__} is of that class. Its module classes are: "
            f"{', '.join(classes) or '(none)'}. Fix: name one of those (e.g. the "
            "transformer block class), or use wrap='auto'."
        )
    return targets
