"""Gradient accumulation windows: where a micro-step sits, and what its loss counts.

k micro-steps of a window equal one step on a k-times larger batch: every loss
backpropagated inside the window counts 1/k, and the gradient synchronisation of
the first k-1 micro-steps is skipped (the strategy's no_sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

from scaletrain.errors import ConfigError

__all__ = ["AccumulationStep", "Accumulator"]


@dataclass(frozen=True, slots=True)
class AccumulationStep:
    """Where a micro-step sits in its accumulation window."""

    index: int
    """0-based micro-step within the window."""
    steps: int
    """Micro-steps per optimizer step."""
    sync: bool
    """True on the last micro-step: gradients were synchronised; step the optimizer."""


class Accumulator:
    """Counts each model's micro-steps and holds the factor losses count by now."""

    def __init__(self) -> None:
        self.scale = 1.0
        """What a loss backpropagated now counts: 1/steps inside a window, else 1."""
        self._micro_steps: dict[int, int] = {}

    @contextlib.contextmanager
    def window(
        self,
        model: nn.Module,
        steps: int,
        no_sync: Callable[[nn.Module], contextlib.AbstractContextManager[None]],
    ) -> Iterator[AccumulationStep]:
        """One micro-step of `model`'s window of `steps`; `no_sync` skips the gradient
        synchronisation on all but the last."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"accumulate(steps={steps!r}): expected a positive integer number of "
                "micro-batches per optimizer step, e.g. steps=4."
            )
        key = id(model)
        index = self._micro_steps.get(key, 0)
        sync = index + 1 >= steps
        self._micro_steps[key] = 0 if sync else index + 1
        previous = self.scale
        self.scale = 1.0 / steps
        context = contextlib.nullcontext() if sync else no_sync(model)
        try:
            with context:
                yield AccumulationStep(index=index, steps=steps, sync=sync)
        finally:
            self.scale = previous
