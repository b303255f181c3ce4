"""A pipeline's step, simulated: every stage's forward and backward of every microbatch
in its schedule's order, each waiting for the stage it depends on (the textbook
bubble, (pp-1)/M of a stage's work, holds for equal stages only; a model has an
embedding and a head at its ends).

Each rank runs its actions in the order of torch.distributed.pipelining's schedule:
`Schedule1F1B` warms up with pp - stage forwards, then alternates a backward and a
forward; `ScheduleGPipe` runs every forward, then every backward;
`ScheduleInterleaved1F1B` holds `virtual` stages per rank, loop placed, in its
`_calculate_single_rank_operations` order. A forward waits for the previous stage's
forward of its microbatch, a backward for the next stage's backward, each `hop`
seconds (the send) after it ended.
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
        warmup = min(m, pp - rank)
        out: list[Action] = [("F", rank, i) for i in range(warmup)]
        for i in range(m):
            out.append(("B", rank, i))
            if warmup + i < m:
                out.append(("F", rank, warmup + i))
        return out
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"interleaved 1F1B over {pp} ranks runs {m} microbatches in rounds of "
                f"{pp}: they must be divisible by the number of rounds ({rounds})"
            )
        per_round, total = m // rounds, m * virtual
        warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), total)

        def nth(step: int) -> tuple[int, int]:
            """(chunk, microbatch) of this rank's step-th forward (or backward): chunks
            take turns in blocks of per_round microbatches."""
            block, i = divmod(step, per_round)
            return block % virtual, block // virtual * per_round + i

        out = []
        for op in range(total + warmup):
            if op < total:
                chunk, i = nth(op)
                out.append(("F", chunk * pp + rank, i))
            if op >= warmup:
                chunk, i = nth(op - warmup)
                out.append(("B", (virtual - 1 - chunk) * pp + rank, i))
        return out
    raise ValueError(
        f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}"
    )


@dataclass(frozen=True, slots=True)
class Timeline:
    """One simulated step."""

    makespan: float
    """Seconds from the first forward to the last rank's end."""
    work: tuple[float, ...]
    """Per rank: seconds of its own actions."""


def simulate(
    forward: Sequence[float],
    backward: Sequence[float],
    *,
    schedule: str,
    microbatches: int,
    virtual: int = 1,
    hop: float = 0.0,
) -> Timeline:
    """`forward[s]`, `backward[s]`: seconds of stage s's forward and backward of one
    microbatch, for pp x `virtual` stages (stage s on rank s % pp)."""
    stages = len(forward)
    if stages != len(backward) or stages % virtual:
        raise ValueError("forward and backward need one time per stage, pp x virtual of them")
    pp = stages // virtual
    orders = [actions(schedule, r, pp, microbatches, virtual) for r in range(pp)]
    ended: dict[Action, float] = {}
    free, pos = [0.0] * pp, [0] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, s, i = orders[r][pos[r]]
                needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs += [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
                if any(n not in ended for n in needs):
                    break
                ready = max([free[r]] + [ended[n] + (hop if n[1] != s else 0.0) for n in needs])
                free[r] = ready + (forward[s] if kind == "F" else backward[s])
                ended[(kind, s, i)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the pipeline schedule deadlocked (a stage waits for nothing)")
    work = [
        sum(forward[s] if k == "F" else backward[s] for k, s, _ in orders[r]) for r in range(pp)
    ]
    return Timeline(max(free), tuple(work))
