"""The one paragraph a hang prints: who, where, which files, what to do."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from scaletrain.observe.hang.diagnosis import HangDiagnosis, _ranks_str
from scaletrain.observe.hang.heartbeat import EXIT_HANG, Heartbeat

__all__ = ["format_hang_message"]

_MAX_DETAILED = 4  # laggards described one by one in the message; the rest are counted


def _describe(hb: Heartbeat, *, top_seq: int | None) -> str:
    text = f"last seen at step {hb.step}, phase {hb.phase!r}, {hb.idle_s:.0f} s ago"
    if hb.where:
        text += f", at {hb.where}"
    if hb.collective:
        text += f" inside {hb.collective}"
    if hb.seq is not None and top_seq is not None and hb.seq < top_seq:
        text += f"; it had issued {hb.seq} collectives, the others {top_seq}"
    if hb.host:
        text += f"; host {hb.host}, pid {hb.pid}"
    return text


def format_hang_message(
    diagnosis: HangDiagnosis,
    heartbeats: Mapping[int, Heartbeat],
    *,
    timeout_s: float,
    hang_dir: Path | str,
    traces: Collection[str] = (),
    nccl_trace: bool = False,
    flight_recorder_hint: bool = False,
) -> str:
    """The one paragraph printed on stderr: who, where, which files, what to do.

    traces: directories holding collective traces; nccl_trace: one is NCCL's (the
    analyzer reads those; Gloo's dumps in torch 2.13 lack the group names it needs);
    flight_recorder_hint: say how to turn the recorder on.
    """
    hang_dir = Path(hang_dir)
    d = diagnosis
    seqs = [heartbeats[r].seq for r in d.waiting if heartbeats[r].seq is not None]
    top_seq = max((s for s in seqs if s is not None), default=None)
    parts = [f"scaletrain: hang detected after {timeout_s:g} s without progress (--hang-timeout):"]
    if d.laggards:
        parts.append(f"rank(s) {_ranks_str(d.laggards)} did not arrive at step {d.step}")
        details = []
        for r in d.laggards[:_MAX_DETAILED]:
            if r in d.missing:
                details.append(f"rank {r}: never sent a heartbeat")
                continue
            hb = heartbeats[r]
            text = f"rank {r}: " + _describe(hb, top_seq=top_seq)
            if r in d.unresponsive:
                text += "; did not answer since (dead, or frozen holding the GIL)"
            if r in d.finished:
                text += "; it had stopped its watchdog (left the training loop)"
            details.append(text)
        if len(d.laggards) > _MAX_DETAILED:
            details.append(f"and {len(d.laggards) - _MAX_DETAILED} more")
        parts[-1] += " (" + "; ".join(details) + ");"
        if d.waiting:
            first = heartbeats[d.waiting[0]]
            where = f" at {first.where}" if first.where else ""
            inside = f" inside {first.collective}" if first.collective else ""
            parts.append(
                f"rank(s) {_ranks_str(d.waiting)} waited in step {d.step}"
                f" (rank {d.waiting[0]}{where}{inside})."
            )
        else:
            parts[-1] = parts[-1].rstrip(";") + "."
        if d.rule:
            parts.append(f"Told apart by: {d.rule}.")
    elif len(heartbeats) <= 1 and d.waiting:
        r = d.waiting[0]
        parts.append(f"rank {r} made no progress ({_describe(heartbeats[r], top_seq=None)}).")
    else:
        blocked = [r for r in d.waiting if heartbeats[r].collective]
        known = all(heartbeats[r].collective is not None for r in d.waiting)
        if d.waiting and len(blocked) == len(d.waiting):
            how = (
                "all wait inside a collective: a network or NCCL problem, or ranks that "
                "called different collectives (e.g. on different subgroups)"
            )
        elif known:
            how = (
                "none is inside a collective: e.g. all blocked on the same file system, "
                "data source or lock"
            )
        else:
            how = "and where they wait is unknown"
        first_rank = d.waiting[0] if d.waiting else next(iter(heartbeats), 0)
        sample = heartbeats.get(first_rank)
        at = (
            f" (rank {first_rank}: {_describe(sample, top_seq=None)})" if sample is not None else ""
        )
        parts.append(
            f"every rank {_ranks_str(d.waiting)} is stalled at step {d.step}{at}; "
            f"no single rank is behind, {how}."
        )
    parts.append(f"Python stacks of every rank: {hang_dir / 'rank*.txt'}.")
    if traces:
        parts.append(
            "Collective trace (flight recorder, pickled, one file per rank): "
            + ", ".join(sorted(traces))
            + (
                " (analyse with: python -m torch.distributed.flight_recorder.fr_trace DIR)."
                if nccl_trace
                else "."
            )
        )
    elif flight_recorder_hint:
        parts.append(
            "No collective trace: call scaletrain.observe.configure_flight_recorder(run_dir) "
            "before the process group is created to record one."
        )
    culprit = f"rank {d.laggards[0]}'s" if d.laggards else "each rank's"
    parts.append(
        f"Fix: read {culprit} stack for what it did instead of joining the others (a "
        "branch taken on some ranks only, uneven data so a rank runs out first, a slow "
        "data load or file access, an exception caught and ignored); if a step "
        f"legitimately takes longer than {timeout_s:g} s (evaluation, checkpointing, a "
        "first compiled step), raise --hang-timeout or call watchdog.beat() inside it."
        f" Every rank exits with code {EXIT_HANG}."
    )
    return " ".join(parts)
