"""A pipeline's step, simulated: every stage's forward and backward of every microbatch
in its schedule's order, waiting for the stages it depends on, sharing the cores.

The formulas for a pipeline's bubble ((pp-1)/M of a stage's work for 1F1B and GPipe,
divided by the model chunks per rank for interleaved 1F1B) hold for equal stages,
each on a device of its own. Neither holds where the planner needs them most: the
ConvNet's first stage holds nearly all of its work, and on a CPU machine with more
processes than cores the stages take turns for the cores as the pipeline fills and
drains it. Simulating the schedule answers both with one rule:

- each rank runs its actions in the order of PyTorch's own schedule
  (torch.distributed.pipelining: `Schedule1F1B` warms up with pp - stage forwards,
  then alternates a backward and a forward; `ScheduleGPipe` runs every forward, then
  every backward; `ScheduleInterleaved1F1B` holds `virtual` stages per rank, loop
  placed, and orders them as its `_calculate_single_rank_operations` does);
- a forward waits for the previous stage's forward of that microbatch, a backward
  for the next stage's backward of it, each `hop` seconds after it ended (the send);
- at every moment the ranks with an action ready share `cores` (processor sharing:
  each runs at min(1, cores / (ranks ready x replicas + background)) of a core);
  `cores=None` gives every rank a device of its own.

What it returns is the step's wall time and, per rank, its work and the time it
waited for another stage (the bubble) or for a core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Timeline", "actions", "simulate"]

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")

Action = tuple[str, int, int]
"""("F" or "B", stage index, microbatch)."""


def actions(schedule: str, rank: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """The forwards and backwards rank `rank` of `pp` runs in one step, in order."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        # Schedule1F1B: the last stage warms up with 1 forward, the first with pp.
        warmup = min(m, pp - rank)
        out: list[Action] = [("F", rank, i) for i in range(warmup)]
        f, b = warmup, 0
        while True:
            out.append(("B", rank, b))
            b += 1
            if f == m:
                break
            out.append(("F", rank, f))
            f += 1
        out += [("B", rank, i) for i in range(b, m)]
        return out
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"interleaved 1F1B over {pp} ranks runs {m} microbatches in rounds of "
                f"{pp}: they must be divisible by the number of rounds ({rounds})"
            )
        per_round = m // rounds
        warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), m * virtual)
        total = m * virtual

        def fwd_stage(step: int) -> int:
            return ((step // per_round) % virtual) * pp + rank

        def bwd_stage(step: int) -> int:
            return (virtual - 1 - ((step - warmup) // per_round) % virtual) * pp + rank

        next_f: dict[int, int] = {}
        next_b: dict[int, int] = {}

        def take(counter: dict[int, int], stage: int) -> int:
            counter[stage] = counter.get(stage, 0) + 1
            return counter[stage] - 1

        out = []
        for op in range(total + warmup):
            if op < total:
                s = fwd_stage(op)
                out.append(("F", s, take(next_f, s)))
            if op >= warmup:
                s = bwd_stage(op)
                out.append(("B", s, take(next_b, s)))
        return out
    raise ValueError(
        f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}"
    )


@dataclass(frozen=True, slots=True)
class Timeline:
    """One simulated step."""

    makespan: float
    """Seconds from the first forward to the last rank's end (its `tail` included)."""
    work: tuple[float, ...]
    """Per rank: seconds of its own actions and tail at a whole core (or device)."""
    running: tuple[float, ...]
    """Per rank: wall seconds it had an action ready (running, or waiting for a core)."""
    idle: tuple[float, ...]
    """Per rank: wall seconds it waited for another stage before its end (its bubble;
    a rank that ends early then waits for the others at the next step)."""


def simulate(
    forward: Sequence[float],
    backward: Sequence[float],
    *,
    schedule: str,
    microbatches: int,
    virtual: int = 1,
    cores: float | None = None,
    replicas: int = 1,
    background: float = 0.0,
    hop: float = 0.0,
    tail: Sequence[float] | None = None,
) -> Timeline:
    """Simulate one step (module docstring).

    `forward[s]` and `backward[s]`: seconds of stage s's forward and backward of one
    microbatch at a whole core, for pp x `virtual` stages (stage s on rank s % pp).
    `replicas`: copies of the pipeline sharing the cores (ddp x pp); `background`:
    other runnable threads on them. `hop`: seconds from a stage's end of an action to
    the next stage's start of the one that needs it (the send). `tail[r]`: rank r's
    work after its last action (the optimizer step)."""
    stages = len(forward)
    if stages != len(backward) or stages % virtual:
        raise ValueError("forward and backward need one time per stage, pp x virtual of them")
    pp = stages // virtual
    orders = [actions(schedule, r, pp, microbatches, virtual) for r in range(pp)]
    ends = list(tail) if tail is not None else [0.0] * pp
    done: dict[Action, float] = {}
    landed: dict[Action, float] = {}  # when an action's output reaches the next stage
    pos = [0] * pp
    left: list[float | None] = [None] * pp
    finished = [False] * pp
    running = [0.0] * pp
    idle = [0.0] * pp
    work = [0.0] * pp
    t = 0.0

    def arrival(a: Action) -> float | None:
        """When the action `a` waits for can start on its rank (None: not yet known)."""
        kind, s, i = a
        needs: list[tuple[Action, dict[Action, float]]] = []
        if kind == "F" and s > 0:
            needs.append((("F", s - 1, i), landed))
        if kind == "B":
            needs.append((("F", s, i), done))
            if s < stages - 1:
                needs.append((("B", s + 1, i), landed))
        worst = 0.0
        for need, when in needs:
            if need not in when:
                return None
            worst = max(worst, when[need])
        return worst

    while True:
        for r in range(pp):
            if left[r] is not None or finished[r]:
                continue
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                at = arrival(a)
                if at is not None and at <= t + 1e-15:
                    cost = forward[a[1]] if a[0] == "F" else backward[a[1]]
                    left[r] = cost
                    work[r] += cost
            else:  # its actions are done: the tail, then it is finished
                left[r] = ends[r]
                work[r] += ends[r]
                finished[r] = True
        busy = [r for r in range(pp) if left[r] is not None]
        if not busy and all(finished):
            break
        share = 1.0
        if cores is not None and busy:
            share = min(1.0, cores / (len(busy) * replicas + background))
        pending = [
            at
            for r in range(pp)
            if left[r] is None and not finished[r]
            for at in [arrival(orders[r][pos[r]])]
            if at is not None and at > t
        ]
        steps = [(left[r] or 0.0) / share for r in busy] + [at - t for at in pending]
        if not steps:
            raise RuntimeError("the pipeline schedule deadlocked (a stage waits for nothing)")
        dt = min(steps)
        for r in range(pp):
            if left[r] is not None:
                running[r] += dt
                left[r] = (left[r] or 0.0) - dt * share
            elif not finished[r]:
                idle[r] += dt
        t += dt
        for r in busy:
            if (left[r] or 0.0) <= 1e-15:
                left[r] = None
                if pos[r] < len(orders[r]):  # an action ended (not the tail)
                    done[orders[r][pos[r]]] = t
                    landed[orders[r][pos[r]]] = t + hop
                    pos[r] += 1
    return Timeline(t, tuple(work), tuple(running), tuple(idle))
