"""The step ledger's state machine: which phase a rank's time belongs to, switched by
the hooks' entry points.

Bracketed phases (data, optimizer, sync) sit on a stack over the loop's base phase
(h2d -> forward -> backward -> comm -> other); evaluation and checkpoints are modes that
absorb everything inside them (an evaluation's own loader waits and reductions count as
eval). Compiling (torch.compile, told by dynamo's compile callbacks: see
`compile_begin`) overrides them all: while torch compiles, nothing else runs on the
thread, whichever phase it interrupted.

`PhaseMachine` is the part of `StepLedger` (scaletrain.observe.metrics.ledger) that
the hooks (scaletrain.observe.metrics.hooks) call; the ledger holds the state and
closes the steps and windows.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from scaletrain.observe.metrics.clocks import Timeline
from scaletrain.observe.metrics.phases import (
    BACKWARD,
    CHECKPOINT,
    COMM,
    COMPILE,
    DATA,
    EVAL,
    FORWARD,
    H2D,
    OPTIMIZER,
    OTHER,
)

__all__ = ["PhaseMachine"]


class PhaseMachine:
    """The phase switching and hook entry points of `StepLedger`, its only subclass,
    which sets the state below in its __init__."""

    _timeline: Timeline
    _cur: int
    _base: int
    _stack: list[int]
    _modes: list[int]
    _sticky_eval: bool
    _loading_steps: int
    _compiling: int
    _active: bool
    _finished: bool
    _buckets: list[tuple[float, float]]
    _spans: list[tuple[float, float]]
    _bwd_start: float
    _flags: list[str]
    closed: int
    flops: Any
    flops_per_step: float | None

    if TYPE_CHECKING:  # StepLedger's, called from here

        def _activate(self) -> None: ...
        def _close_step(self) -> None: ...
        def _write_flops(self) -> None: ...
        def say(self, message: Any) -> None: ...

    # -- switching --------------------------------------------------------------------
    def _switch(self) -> None:
        if self._compiling:
            new = COMPILE
        elif self._modes:
            new = self._modes[-1]
        elif self._stack:
            new = self._stack[-1]
        else:
            new = self._base
        if new != self._cur:
            self._timeline.switch(self._cur)
            self._cur = new

    def push(self, phase: int) -> None:
        if self._finished:
            return
        if not self._active:
            self._activate()
        self._stack.append(phase)
        self._switch()

    def pop(self, phase: int) -> None:
        if self._stack and self._stack[-1] == phase:
            self._stack.pop()
            self._switch()

    def data_arrived(self) -> None:
        """The loader handed out a batch: until forward starts, it is on its way (h2d)."""
        if self._stack and self._stack[-1] == DATA:
            self._stack.pop()
            if self._base == OTHER:
                self._base = H2D
            self._switch()

    def set_base(self, phase: int) -> None:
        if self._finished:
            return
        if not self._active:
            self._activate()
        self._base = phase
        self._switch()

    def begin_mode(self, phase: int) -> None:
        """Evaluation or a checkpoint: everything until end_mode counts as `phase`."""
        if self._finished:
            return
        if not self._active:
            self._activate()
        self._modes.append(phase)
        self._switch()

    def end_mode(self, phase: int) -> None:
        if phase in self._modes:
            del self._modes[len(self._modes) - 1 - self._modes[::-1].index(phase)]
            self._switch()

    def compile_begin(self) -> None:
        """torch.compile started compiling (dynamo's start callback, on the thread that
        compiles: forward's, or the autograd engine's for a backward compiled lazily at
        its first run): until `compile_end`, the time is compile's. The step is flagged
        "compile" (left out of the statistics). Before the first hook (no step yet) and
        after the end it is nobody's."""
        if self._finished or not self._active:
            return
        self._compiling += 1
        if self._compiling == 1:
            if "compile" not in self._flags:
                self._flags.append("compile")
            self._switch()

    def compile_end(self) -> None:
        if self._compiling:
            self._compiling -= 1
            if not self._compiling:
                self._switch()

    # -- hook entry points ------------------------------------------------------------
    def forward_begin(self, grad_enabled: bool) -> None:
        if not grad_enabled:
            # A forward without gradients in the training loop: evaluation, which lasts
            # until the next training forward.
            if not self._sticky_eval:
                self._sticky_eval = True
                self.begin_mode(EVAL)
            return
        if self._sticky_eval:
            self._sticky_eval = False
            self.end_mode(EVAL)
        flops = self.flops
        first = flops is not None and self.closed == 0 and not flops.active
        if first and flops.total is None and not flops.start():
            self.flops = None
            self.say(
                "scaletrain: no FLOP count, so no MFU: the model was compiled after "
                "rt.setup, and counting inside torch.compile would keep it from ever "
                "compiling. Fix: torch.compile(model) before rt.setup(model, ...) for MFU."
            )
        self.set_base(FORWARD)

    def end_eval(self) -> None:
        """Evaluation is over (the trainer says so; a plain loop's next training forward
        does too)."""
        if self._sticky_eval:
            self._sticky_eval = False
            self.end_mode(EVAL)

    def backward_begin(self) -> None:
        self._bwd_start = time.perf_counter()
        self.set_base(BACKWARD)

    def compute_end(self) -> None:
        """Backward's last gradient is computed; what remains is waiting on collectives."""
        self._spans.append((self._bwd_start, time.perf_counter()))
        self.set_base(COMM)

    def backward_end(self) -> None:
        self.set_base(OTHER)

    def bucket(self, ready: float, done: float) -> None:
        """A gradient bucket's all-reduce ran from `ready` to `done` (perf_counter)."""
        self._buckets.append((ready, done))

    def optimizer_begin(self) -> None:
        if CHECKPOINT in self._modes:
            # Loading optimizer state runs a step of zero gradients to create it
            # (torch.distributed.checkpoint's state-dict API): no training step.
            self._loading_steps += 1
            return
        if self.flops is not None and self.flops.active:
            # The model's FLOPs, for MFU: a checkpoint's recomputation left out.
            self.flops_per_step = float(self.flops.stop() - getattr(self.flops, "recomputed", 0))
            self._flags.append("flops")
            self._write_flops()
            for problem in getattr(self.flops, "problems", ()):
                self.say(
                    f"scaletrain: the FLOP count (for MFU) left out {problem}; the MFU shown "
                    "is a lower bound."
                )
        self.push(OPTIMIZER)

    def optimizer_end(self) -> None:
        if self._loading_steps:
            self._loading_steps -= 1
            return
        self.pop(OPTIMIZER)
        self._base = OTHER
        self._switch()
        self._close_step()
