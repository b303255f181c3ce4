"""Package attributes imported on first use (PEP 562), so importing a package is cheap.

`import scaletrain` and the CLI's `--help` must not pay for torch (seconds); the
public names still read as `scaletrain.init`, `scaletrain.train.Trainer`, ...
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["import_quietly", "lazy_attributes"]


def lazy_attributes(
    package: str, namespace: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each name in `where` is imported from
    the module it maps to when first read, then kept in `namespace` (the package's
    globals) so the next read is a plain attribute."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = importlib.import_module(module)
        if module != f"{package}.{name}":  # else the name is that subpackage itself
            value = getattr(value, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        # What a user may read: the public names, the dunders and the submodules; not
        # what the package imported for itself (TYPE_CHECKING, annotations, this helper).
        public = set(namespace.get("__all__", ())) | set(where)
        shown = {
            name
            for name, value in namespace.items()
            if name.startswith("__")
            or (isinstance(value, types.ModuleType) and not name.startswith("_"))
        }
        return sorted(public | shown)

    return __getattr__, __dir__


_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers that write while their module is imported, on every run and every rank:
torchao's, for each CUDA extension of kernels scaletrain does not use that this
machine cannot load (an mxfp8 or a CUTLASS one on a CPU), and torch's pytree's, for a
deprecation torchao's own registrations trigger. Notes to those libraries' developers,
not to a user."""


def import_quietly(name: str) -> types.ModuleType:
    """`name` imported with `_IMPORT_NOISE`'s warnings held back (errors still show)."""
    import logging

    loggers = [logging.getLogger(n) for n in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
