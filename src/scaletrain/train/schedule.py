"""The learning rate as a function of the step: warm-up, then cosine, linear or constant.

A pure function of (step, run length), not a scheduler object with hidden state:
the checkpoint holds the step, and a resumed run recomputes its learning rate from
the config, so a run can be extended or shortened on resume. Warm-up is a number
of steps, not a fraction of the run: a 20-step trial then starts as gently as a
long run does (a fraction of 20 steps is a jump to the peak within 3 steps, which
throws the seeds' ConvNet to a loss of 15-20 before it recovers).
"""

from __future__ import annotations

import math

import torch

from scaletrain.train.config import SCHEDULES

__all__ = ["lr_at", "set_lr"]


def lr_at(step: int, *, peak: float, total_steps: int, warmup: int, schedule: str) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `total_steps`.

    Steps 0 .. warmup-1 rise linearly to `peak` ((step + 1) / warmup of it); after
    that "cosine" and "linear" decay to 0 at the last step and "constant" stays.
    The warm-up part does not depend on `total_steps`: two runs of different length
    share their learning rates, hence their weights, while both are warming up.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    decay_steps = total_steps - warmup
    if decay_steps <= 0:
        return peak
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Give every parameter group of `optimizer` the learning rate `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = lr
