"""The strategy axis: how a model is placed and wrapped for many devices.

A strategy is a small dataclass whose fields are its configuration
(`st.DDP(bucket_cap_mb=50)`) and whose methods do the wrapping. Users pick one by
name ("ddp") or by instance; the registry maps names to classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from scaletrain.errors import ConfigError

if TYPE_CHECKING:
    from scaletrain.runtime import Runtime

__all__ = ["STRATEGIES", "Strategy", "register", "resolve_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy under its `name`."""
    STRATEGIES[cls.name] = cls
    return cls


@dataclass(kw_only=True, slots=True)
class Strategy:
    """Base class. Public methods own the checks; subclasses implement the `_hooks`."""

    name: ClassVar[str] = "base"

    def validate(self, rt: Runtime) -> None:
        """Fail before training if this strategy cannot work on rt's backend/devices."""
        self._validate(rt)

    def setup_module(self, module: nn.Module, rt: Runtime) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"setup() expected a torch.nn.Module, got {type(module).__name__}. Pass the model "
                "itself, e.g. rt.setup(model, optimizer)."
            )
        return self._setup_module(module, rt)

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, rt: Runtime
    ) -> torch.optim.Optimizer:
        return self._setup_optimizer(optimizer, module, rt)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module, without wrapper prefixes in its state dict."""
        return self._unwrap(module)

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        with self._no_sync(module):
            yield

    def data_parallel(self, rt: Runtime) -> tuple[int, int]:
        """(rank, size) among the replicas that see different data."""
        return rt.rank, rt.world_size

    # -- hooks -----------------------------------------------------------------
    def _validate(self, rt: Runtime) -> None:
        return None

    def _setup_module(self, module: nn.Module, rt: Runtime) -> nn.Module:
        return module.to(rt.device)

    def _setup_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, rt: Runtime
    ) -> torch.optim.Optimizer:
        return optimizer

    def _unwrap(self, module: nn.Module) -> nn.Module:
        return module

    def _no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def resolve_strategy(spec: str | Strategy | None) -> Strategy:
    """A strategy instance from a name, an instance, or None (DDP)."""
    if spec is None:
        spec = "ddp"
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in STRATEGIES:
            return STRATEGIES[key]()
    raise ConfigError(
        f"strategy={spec!r} is not known; expected one of {', '.join(sorted(STRATEGIES))} "
        "or a strategy object such as st.DDP(bucket_cap_mb=50)."
    )
