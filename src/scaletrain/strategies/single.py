"""One device, no wrapper: what every strategy falls back to at world size 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from scaletrain.strategies.base import Strategy, register

__all__ = ["SingleDevice"]


@register
@dataclass(kw_only=True, slots=True)
class SingleDevice(Strategy):
    """Move the model to this process's device and train it as is."""

    name: ClassVar[str] = "single"
