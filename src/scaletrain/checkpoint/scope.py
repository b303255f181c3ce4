"""Who saves and loads: this rank's topology and how the strategy presents its models.

Checkpoints need the rank, world size and device (the Topology) and two views of
a model the strategy owns: the user's module inside its wrapper (`unwrap`) and the
module whose state this rank holds (`checkpoint_module`: a pipeline rank's stages).
They get exactly that, as plain values, so checkpoints depend on no strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from scaletrain.dist.topology import Topology

__all__ = ["CheckpointScope", "ScopeSource", "as_scope"]


def _same(module: nn.Module) -> nn.Module:
    return module


@dataclass(frozen=True, slots=True)
class CheckpointScope:
    """This rank's part in a checkpoint: where it runs, and the strategy's model views."""

    topology: Topology
    """Rank, world size and device of this process."""
    unwrap: Callable[[nn.Module], nn.Module] = _same
    """The user's module inside whatever wrapper the strategy added (DDP's `module.`)."""
    checkpoint_module: Callable[[nn.Module], nn.Module] = _same
    """The module whose state this rank saves and loads (a pipeline rank: its stages)."""
    timed: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """Brackets each save and load: the step ledger counts the time inside as the
    checkpoint phase, and an optimizer step a load runs (torch's state-dict API steps
    once with zero gradients to create the state it fills) as no training step."""


class ScopeSource(Protocol):
    """Anything that can describe its checkpoint scope: what `st.init` returns does."""

    def checkpoint_scope(self) -> CheckpointScope: ...


def as_scope(source: CheckpointScope | ScopeSource) -> CheckpointScope:
    """`source` itself, or the scope it describes."""
    return source if isinstance(source, CheckpointScope) else source.checkpoint_scope()
