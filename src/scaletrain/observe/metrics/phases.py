"""The phases of a training step, as the step ledger names them.

Every moment of a rank's training time belongs to exactly one phase, so the phases
of a step add up to its wall time (the time from the end of the previous optimizer
step to the end of this one). The names are part of the on-disk format
(RUN/observe/rank<r>.jsonl): add, never rename.
"""

from __future__ import annotations

__all__ = [
    "BACKWARD",
    "CHECKPOINT",
    "COMM",
    "COMPILE",
    "COMPUTE_PHASES",
    "DATA",
    "EVAL",
    "FORWARD",
    "H2D",
    "OPTIMIZER",
    "OTHER",
    "PHASES",
    "PHASE_DOCS",
    "STRAGGLER_PHASES",
    "SYNC",
]

PHASES: tuple[str, ...] = (
    "data",
    "h2d",
    "forward",
    "backward",
    "comm",
    "optimizer",
    "sync",
    "checkpoint",
    "eval",
    "other",
    "compile",
)
DATA, H2D, FORWARD, BACKWARD, COMM, OPTIMIZER, SYNC, CHECKPOINT, EVAL, OTHER, COMPILE = range(
    len(PHASES)
)

PHASE_DOCS: dict[str, str] = {
    "data": "waiting for the loader's next batch",
    "h2d": "from the batch's arrival to the start of forward: the copy to the device",
    "forward": "the model's forward and the loss, up to the start of backward",
    "backward": "backward computation (gradients)",
    "comm": "exposed communication: blocked on the gradient all-reduce after backward's "
    "compute is done (the part the overlap did not hide); a pipeline stage's waiting for "
    "the other stages (sends, receives, the fill and drain)",
    "optimizer": "gradient clipping and the optimizer step",
    "sync": "collectives outside forward/backward: collecting the per-step stop agreement "
    "(rt.any_rank_async, started a step earlier), rt.reduce, barriers, and the ledger's own "
    "gather every K steps",
    "checkpoint": "training stalled in rt.save / rt.load",
    "eval": "evaluation between steps",
    "other": "everything else in the loop (zero_grad, logging, the user's own code)",
    "compile": "torch.compile compiling (dynamo's trace, AOT autograd, the backend's code "
    "generation), whatever phase it interrupts: in forward, in backward (a backward compiled "
    "lazily at its first run), in evaluation, and every recompilation later on. A step that "
    "compiled is left out of the statistics (step time, MFU, stragglers), as the warm-up "
    "step is; its compile seconds are summed on their own",
}

COMPUTE_PHASES: tuple[int, ...] = (H2D, FORWARD, BACKWARD, OPTIMIZER)
"""Phases a rank spends computing on its own (no peer involved). Compiling is not
training's compute: it is left out (and so are the steps that compiled)."""

STRAGGLER_PHASES: tuple[int, ...] = (DATA, H2D, FORWARD, BACKWARD, OPTIMIZER)
"""Phases compared across ranks to name a straggler. Collective time is left out (as
NVIDIA's straggler detector does): a collective makes every rank equally long, the fast
ones waiting for the slow one, which would hide it. Compile is left out too: a rank
that compiled longer (a cold cache, a slower CPU for the code generation) is no
straggler, and a step that compiled never reaches a window's statistics anyway."""
