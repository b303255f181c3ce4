"""Who held a hung job up: the "who did not arrive" rules over every rank's heartbeat.

Pure functions of the heartbeats, so every rule is testable without processes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from scaletrain.errors import ConfigError
from scaletrain.observe.hang.heartbeat import Heartbeat

__all__ = ["HangDiagnosis", "find_laggards"]


@dataclass(frozen=True, slots=True)
class HangDiagnosis:
    """Who held the job up, as `find_laggards` worked it out."""

    step: int
    """The furthest step any running rank reached (where the waiting ranks wait)."""
    laggards: tuple[int, ...]
    """Ranks that did not arrive: the ones the others wait for."""
    waiting: tuple[int, ...]
    """Running ranks that arrived and waited."""
    missing: tuple[int, ...] = ()
    """Ranks that never published a heartbeat (no watchdog, or died before)."""
    unresponsive: tuple[int, ...] = ()
    """Ranks that did not answer the dump request: dead, or frozen holding the GIL."""
    finished: tuple[int, ...] = ()
    """Ranks that had stopped their watchdog: they left and will not arrive."""
    rule: str = ""
    """How the laggards were told apart from the waiting ranks, in words."""


def find_laggards(
    heartbeats: Mapping[int, Heartbeat],
    world_size: int,
    responsive: Collection[int] | None = None,
) -> HangDiagnosis:
    """Name the ranks that did not arrive, from every rank's last heartbeat.

    The rules, applied together (a rank named by any of them is a laggard):

    1. missing: a rank with no heartbeat at all (never started a watchdog, or died
       before its first publication).
    2. unresponsive: with `responsive` given (the ranks that answered the dump
       request), a running rank not in it: its process is dead, or frozen in native
       code that holds the GIL so its watchdog thread cannot run.
    3. finished: a rank that stopped its watchdog (it left the training loop, e.g. it
       ran out of data first) while others still wait for it.
    Among the remaining (live, running) ranks, with S the furthest step among them:
    4. behind: a rank whose last step is below S did not arrive at step S.
    5. If all are at S: a rank that issued fewer collectives on the default process
       group than the most advanced one did not enter the collective the others wait
       in (used only when every such rank reported its count).
    6. If those counts tie (or are unknown): when some ranks are blocked inside a
       torch.distributed call and others are not, the ones outside did not arrive.
    If no rule names anyone, every rank is stalled at the same place (all inside a
    collective, or all outside one) and `laggards` is empty: the message says so.
    """
    if world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be >= 1.")
    ranks = range(world_size)
    missing = tuple(r for r in ranks if r not in heartbeats)
    present = [r for r in ranks if r in heartbeats]
    finished = tuple(r for r in present if heartbeats[r].stopped)
    running = [r for r in present if not heartbeats[r].stopped]
    unresponsive: tuple[int, ...] = ()
    if responsive is not None:
        answered = set(responsive)
        unresponsive = tuple(r for r in running if r not in answered)
    live = [r for r in running if r not in unresponsive]

    rules: list[str] = []
    if missing:
        rules.append("no heartbeat from rank(s) " + _ranks_str(missing))
    if unresponsive:
        rules.append(
            "rank(s) " + _ranks_str(unresponsive) + " did not answer (dead, or frozen "
            "in native code holding the GIL)"
        )
    if finished:
        rules.append("rank(s) " + _ranks_str(finished) + " had finished (watchdog stopped)")

    if not live:
        step = max((heartbeats[r].step for r in present), default=-1)
        laggards = tuple(sorted({*missing, *unresponsive, *finished}))
        return HangDiagnosis(
            step=step,
            laggards=laggards,
            waiting=(),
            missing=missing,
            unresponsive=unresponsive,
            finished=finished,
            rule="; ".join(rules),
        )

    step = max(heartbeats[r].step for r in live)
    behind = [r for r in live if heartbeats[r].step < step]
    late: list[int] = list(behind)
    if behind:
        rules.append(f"behind: last step below {step}")
    else:
        seqs = [heartbeats[r].seq for r in live]
        colls = [heartbeats[r].collective for r in live]
        if len(live) > 1 and all(s is not None for s in seqs) and len(set(seqs)) > 1:
            top = max(s for s in seqs if s is not None)
            late = [r for r in live if (heartbeats[r].seq or 0) < top]
            rules.append(
                f"fewer collectives issued (the others had issued {top}): they did not "
                "enter the collective the others wait in"
            )
        elif len(live) > 1 and all(c is not None for c in colls):
            inside = [r for r in live if heartbeats[r].collective]
            if inside and len(inside) < len(live):
                late = [r for r in live if r not in inside]
                rules.append("outside torch.distributed while the others wait inside a collective")
    laggards = tuple(sorted({*missing, *unresponsive, *finished, *late}))
    waiting = tuple(r for r in live if r not in laggards)
    return HangDiagnosis(
        step=step,
        laggards=laggards,
        waiting=waiting,
        missing=missing,
        unresponsive=unresponsive,
        finished=finished,
        rule="; ".join(rules),
    )


def _ranks_str(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "[0-2, 5]": readable at thousands of ranks."""
    values = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return "[" + ", ".join(parts) + "]"
