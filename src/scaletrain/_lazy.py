"""Package attributes imported on first use (PEP 562), so importing a package is cheap.

`import scaletrain` and the CLI's `--help` must not pay for torch (seconds); the
public names still read as `scaletrain.init`, `scaletrain.train.Trainer`, ...
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["import_quietly", "lazy_attributes", "on_meta", "quiet_imports"]


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


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """What is imported inside, with `_IMPORT_NOISE`'s warnings held back (errors still
    show): scaletrain's own imports of those libraries, and a user's model module that
    imports transformers itself."""
    import logging

    loggers = [logging.getLogger(n) for n in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def import_quietly(name: str) -> types.ModuleType:
    """`name` imported with `_IMPORT_NOISE`'s warnings held back (errors still show)."""
    with quiet_imports():
        return importlib.import_module(name)


_RANDOM_FILLS = frozenset(
    {"normal_", "uniform_", "log_normal_", "exponential_", "cauchy_", "geometric_", "random_"}
)
"""torch's in-place random fills: they only set values, which a meta tensor has none of."""


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`with torch.device("meta")` for building a model only to read its structure,
    without drawing random values into meta tensors: the tensors' random fills
    (`_RANDOM_FILLS`, which torch.nn.init's functions call) and `torch.nn.init.normal_`
    (which hands the mode its own call) are skipped on them, each run on one CPU value
    instead to refuse what it refuses; everything around them still runs
    (kaiming_normal_ of a 1-D tensor still raises). A meta tensor has no values, so this
    changes nothing a build on meta makes. The reason: torch's meta kernel of
    `normal_` (nn.Embedding's initialisation and most Hugging Face models') first
    imports torch's compiler, seconds of every launch that checks a model before any
    process starts."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _NoNormalDraws(TorchFunctionMode):
        def __torch_function__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            # torch.nn.init's functions hand their tensor on by keyword (tensor=).
            target = args[0] if args else kwargs.get("tensor")
            if not isinstance(target, torch.Tensor) or not target.is_meta:
                return func(*args, **kwargs)
            name = getattr(func, "__name__", None)
            initialiser = getattr(func, "__module__", None) == "torch.nn.init"
            if name != "normal_" if initialiser else name not in _RANDOM_FILLS:
                return func(*args, **kwargs)
            _check_on_one_value(func, target, args, kwargs)
            return target

    def _check_on_one_value(
        func: Any, target: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The fill run on one value of the target's dtype on the CPU (no compiler
        there), so what it refuses is refused as the build on meta refused it: a
        negative std, an integer tensor, a leaf that requires a gradient. Not with a
        generator of the user's, which may be of another device."""
        if any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
            return
        one = torch.empty(1, dtype=target.dtype, device="cpu")
        if target.requires_grad:
            one = one.requires_grad_() if target.is_leaf else one.requires_grad_().clone()
        if args:
            func(one, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": one})

    with torch.device("meta"), _NoNormalDraws():
        yield
