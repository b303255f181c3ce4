"""The whole run in one table: phase x (min, median, max over ranks, the rank named), plus
overlap, MFU, memory, the stragglers and one line of advice when a pattern is clear.

Per rank, a phase's value is its MEAN seconds per step over the counted steps (warm-up,
profiled and compiling steps left out): means add up to the mean step, and rare phases
(checkpoints, evaluation) count for what they cost. Windows use medians instead (a
straggler must be slow typically, not once).

torch.compile's time is reported on its own line ("compile 41.2 s in steps 1-2"), the
slowest rank's, and only when something compiled. The step time and MFU leave out the
steps that compiled, whole (the ledger's rule, scaletrain.observe.metrics.ledger): they describe
training at its pace, not the compiler; the compile line says what it cost on top.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import say, spell
from scaletrain.observe.metrics.flops import compute_mfu, forget_peak
from scaletrain.observe.metrics.phases import PHASES
from scaletrain.observe.metrics.stragglers import what_slowed
from scaletrain.observe.metrics.window import WindowStats

__all__ = [
    "advice",
    "build_summary",
    "compile_line",
    "print_line",
    "print_summary",
    "summary_line",
    "summary_table",
    "unmeasured_reason",
]


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def build_summary(ledger: Any, stats: WindowStats) -> dict[str, Any]:
    """summary.json's content from the ledger and the run-level gather."""
    ranks = []
    mfus = []
    for w in stats.ranks:
        entry: dict[str, Any] = {
            "rank": w.rank,
            "peer_group": w.peer_group,
            "steps": w.steps,
            "step": w.wall,
            "phases": dict(zip(PHASES, w.phases, strict=True)),
            "comm_busy": _finite(w.comm_busy),
            "overlap": _finite(w.overlap),
            "cpu": _finite(w.cpu),
            "cpu_wait": _finite(w.cpu_wait),
            "allocated_peak": _finite(w.allocated_peak),
            "reserved_peak": _finite(w.reserved_peak),
            "rss_peak": _finite(w.rss_peak),
            "gpu_util": _finite(w.gpu_util),
            "flops_per_step": _finite(w.flops),
            "compile_s": w.compile_s,
            "compile_steps": int(w.compile_steps),
        }
        if not math.isnan(w.flops) and w.wall > 0 and w.steps > 0:
            mfu = compute_mfu(w.flops, w.wall, ledger.peak_measured, ledger.peak_datasheet)
            entry["mfu"] = mfu.as_dict()
            mfus.append(mfu)
            if w.rank == ledger.rank and (mfu.mfu_measured or 0.0) > 1.0:
                # Its own node's cached peak is too low: measured while the device was busy.
                forget_peak(
                    ledger.device_name, ledger.peak_dtype, processes=ledger.local_world_size
                )
        ranks.append(entry)
    named = [s.as_dict() for s in ledger.detector.named.values()]
    summary: dict[str, Any] = {
        "v": 1,
        "world_size": ledger.world_size,
        "first_step": stats.first_step,
        "last_step": stats.last_step,
        "clock": ledger._timeline.kind,
        "device": ledger.device_type,
        "device_name": ledger.device_name,
        "statistic": "mean seconds per step",
        "phases": {k: v.as_dict() for k, v in stats.spreads.items()},
        "ranks": ranks,
        "stragglers": named,
        "peak": {
            "dtype": ledger.peak_dtype,
            "measured": ledger.peak_measured,
            "datasheet": ledger.peak_datasheet,
        },
        "mfu": _mfu_overall(mfus),
        "compile": _compile_overall(stats),
    }
    summary["advice"] = advice(summary)
    return summary


def _compile_overall(stats: WindowStats) -> dict[str, Any] | None:
    """The run's compile time: the slowest rank's seconds (its peers wait for it at the
    next collective), the steps that compiled on any rank; None when none did."""
    compiled = [w for w in stats.ranks if w.compile_steps > 0]
    if not compiled:
        return None
    top = max(compiled, key=lambda w: (w.compile_s, -w.rank))
    return {
        "seconds": top.compile_s,
        "rank": top.rank,
        "median": statistics.median(w.compile_s for w in stats.ranks),
        "steps": int(max(w.compile_steps for w in compiled)),
        "first_step": int(min(w.compile_first for w in compiled)),
        "last_step": int(max(w.compile_last for w in compiled)),
    }


def _seconds(x: float) -> str:
    return f"{x:,.1f} s" if x >= 1 else f"{x * 1e3:,.0f} ms"


def compile_line(summary: dict[str, Any]) -> str | None:
    """torch.compile's cost in a few words ("compile 41.2 s in steps 1-2"), None when
    nothing compiled (or a summary from before the compile phase existed)."""
    c = summary.get("compile")
    if not c:
        return None
    first, last, n = c["first_step"], c["last_step"], c["steps"]
    if first == last:
        where = f"step {first}"
    elif n == last - first + 1:
        where = f"steps {first}-{last}"
    else:
        where = f"{n} steps from {first} to {last}"
    rank = f", rank {c['rank']}" if summary.get("world_size", 1) > 1 else ""
    return f"compile {_seconds(c['seconds'])} in {where}{rank}"


def _mfu_overall(mfus: list[Any]) -> dict[str, Any] | None:
    if not mfus:
        return None

    def med(key: str) -> float | None:
        values = [getattr(m, key) for m in mfus if getattr(m, key) is not None]
        return statistics.median(values) if values else None

    errors = sorted({m.error for m in mfus if m.error})
    return {
        "measured": med("mfu_measured"),
        "datasheet": med("mfu_datasheet"),
        "achieved": med("achieved"),
        "error": errors[0] if errors else None,
    }


def _share(summary: dict[str, Any], phase: str) -> float:
    step = summary["phases"]["step"]["median"]
    value = summary["phases"][phase]["median"]
    if not step or step != step or value != value:
        return 0.0
    return float(value / step)


def advice(summary: dict[str, Any]) -> str | None:
    """One line when a pattern is clear: a straggler, data-bound, communication-bound,
    checkpoint or evaluation stalls; None when nothing stands out."""
    if summary["stragglers"]:
        s = max(summary["stragglers"], key=lambda x: x["cost_s"])
        cost = f"its peers wait {s['cost_s'] * 1e3:.1f} ms per step for it ({s['cost_fraction']:.0%} of the step)"
        if s.get("waited_for_cpu"):
            return (
                f"Straggler: rank {s['rank']} {what_slowed(s)}; {cost}. Not its device: "
                "fewer processes on that host than it has cores, or other jobs moved off "
                "it, make it even."
            )
        fix = (
            f"its loader is slower than its peers' (its node's disk or CPUs; "
            f"{spell('num_workers')} helps if the CPUs are free)"
            if s["phase"] == "data"
            else "check that rank's device and node (clocks, temperature, other jobs)"
        )
        return (
            f"Straggler: rank {s['rank']} is {s['slower']:.2f}x slower than its fastest peer "
            f"in {s['phase']}; {cost}. {fix[0].upper()}{fix[1:]}."
        )
    data, comm = _share(summary, "data"), _share(summary, "comm")
    sync = _share(summary, "sync")
    if data >= 0.15:
        return (
            f"Data-bound: ranks wait {data:.0%} of each step for the next batch. Raise "
            f"{spell('num_workers')} (loader processes per rank) or make the dataset's "
            "__getitem__ cheaper."
        )
    stages = {r["peer_group"] for r in summary["ranks"]}
    if comm >= 0.2 and len(stages) > 1:
        return _pipeline_advice(summary, comm)
    if comm >= 0.2:
        overlaps = [r["overlap"] for r in summary["ranks"] if r.get("overlap") is not None]
        hidden = f" (overlap {statistics.median(overlaps):.0%})" if overlaps else ""
        return (
            f"Communication-bound: {comm:.0%} of each step is blocked on the gradient "
            f"all-reduce after backward{hidden}. A larger batch per rank, DDP(bucket_cap_mb=...) "
            "or comm_hook='fp16' hide or shrink it."
        )
    checkpoint, evaluation = _share(summary, "checkpoint"), _share(summary, "eval")
    if checkpoint >= 0.1:
        return (
            f"Checkpoints stall training {checkpoint:.0%} of the time: save less often; "
            f"{spell('async_save', True)} writes them in the background (where it is on "
            "already, this is the copy of the state it takes first)."
        )
    if evaluation >= 0.25:
        return (
            f"Evaluation takes {evaluation:.0%} of the time: {spell('eval_batches')} "
            "evaluates on part of the test set."
        )
    if sync >= 0.1:
        return (
            f"Per-step synchronisation (stop agreement, reductions) takes {sync:.0%} of each "
            "step: reduce less often."
        )
    return None


def _pipeline_advice(summary: dict[str, Any], comm: float) -> str:
    """Ranks in several peer groups are pipeline stages (the groups: their stage
    coordinate), and a stage's comm is waiting for the others: its sends and receives,
    the pipeline's fill and drain, and a lighter stage's idling behind a heavier one."""
    work: dict[int, list[float]] = {}
    for r in summary["ranks"]:
        work.setdefault(r["peer_group"], []).append(
            r["phases"]["forward"] + r["phases"]["backward"]
        )
    per = {g: statistics.median(v) for g, v in work.items()}
    heavy, light = max(per, key=lambda g: per[g]), min(per, key=lambda g: per[g])
    head = (
        f"Pipeline-bound: stages wait {comm:.0%} of each step for each other (sends, "
        "receives, the pipeline's fill and drain)."
    )
    stages = say(api="Pipeline(stages=[...])", cli="st.Pipeline(stages=[...]) in the library")
    if per[light] < 0.67 * per[heavy]:
        return (
            f"{head} Its stages are unequal: pipeline rank {heavy} computes "
            f"{per[heavy] * 1e3:.1f} ms per step, pipeline rank {light} "
            f"{per[light] * 1e3:.1f} ms; split points that move layers to the lighter "
            f"stage ({stages}) even them out."
        )
    more = say(api="Pipeline(microbatches=...)", cli="st.Pipeline(microbatches=...) in the library")
    return f"{head} More microbatches per batch ({more}) shrink the fill and drain."


def _ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "-"
    return f"{seconds * 1e3:,.2f}"


def summary_table(summary: dict[str, Any]) -> Any:
    """A rich Table of phase x min / median / max over ranks."""
    from rich.table import Table

    world = summary["world_size"]
    counted = max((r["steps"] for r in summary["ranks"]), default=0)
    skipped = (
        "warm-up, compiling and profiled" if summary.get("compile") else "warm-up and profiled"
    )
    table = Table(
        title=f"where the time goes: ms per step (mean of {counted} step{'s' * (counted != 1)} in "
        f"{summary['first_step']}-{summary['last_step']}, {skipped} steps left "
        f"out; min / median / max over {world} rank{'s' if world != 1 else ''})",
        title_justify="left",
    )
    for name, justify in (
        ("phase", "left"),
        ("min", "right"),
        ("rank", "right"),
        ("median", "right"),
        ("max", "right"),
        ("rank", "right"),
        ("share", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    step = summary["phases"]["step"]["median"]
    for name in (*PHASES, "step"):
        s = summary["phases"][name]
        if name != "step" and not (s["max"] or 0) > 0:
            continue
        share = f"{s['median'] / step:.0%}" if step and s["median"] is not None else "-"
        table.add_row(
            name if name != "step" else "[bold]step[/]",
            _ms(s["min"]),
            str(s["min_rank"]),
            _ms(s["median"]),
            _ms(s["max"]),
            str(s["max_rank"]),
            share if name != "step" else "",
        )
    return table


def _lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    compiled = compile_line(summary)
    if compiled:
        lines.append(
            f"torch.compile: {compiled.removeprefix('compile ')} (the slowest rank), left out "
            "of the step times and MFU: those steps are not in the table"
        )
    overlaps = [(r["rank"], r["overlap"]) for r in summary["ranks"] if r.get("overlap") is not None]
    if overlaps:
        lo = min(overlaps, key=lambda x: x[1])
        lines.append(
            f"gradient all-reduce hidden behind backward: median "
            f"{statistics.median(v for _, v in overlaps):.0%}, lowest {lo[1]:.0%} (rank {lo[0]})"
        )
    mfu = summary.get("mfu")
    if mfu:
        peak = summary["peak"]
        parts = []
        if mfu.get("measured") is not None:
            parts.append(f"{mfu['measured']:.1%} of the measured {peak['dtype']} peak")
        if mfu.get("datasheet") is not None:
            parts.append(f"{mfu['datasheet']:.1%} of the datasheet peak")
        else:
            parts.append(f"no datasheet peak known for {summary['device_name']}")
        achieved = mfu.get("achieved") or 0.0
        rate = (
            f"{achieved / 1e12:.3f} TFLOP/s"
            if achieved >= 1e11
            else f"{achieved / 1e9:.2f} GFLOP/s"
        )
        lines.append(f"MFU: {', '.join(parts)} ({rate})")
        if mfu.get("error"):
            lines.append(f"[bold red]measurement error:[/] {mfu['error']}")
        if (mfu.get("measured") or 0.0) > 1.0:
            lines.append(
                "the measured peak is dropped from the cache: the next run measures it again"
            )
    mem = [
        (r["rank"], r.get("allocated_peak") or r.get("rss_peak"))
        for r in summary["ranks"]
        if (r.get("allocated_peak") or r.get("rss_peak"))
    ]
    if mem:
        what = "CUDA allocated" if summary["ranks"][0].get("allocated_peak") else "RSS"
        top = max(mem, key=lambda x: x[1])
        lines.append(f"peak memory ({what}): max {top[1] / 2**20:,.0f} MiB (rank {top[0]})")
    for s in summary["stragglers"]:
        lines.append(
            f"straggler: rank {s['rank']} {what_slowed(s)}, named at steps "
            f"{s['first_step']}-{s['last_step']}; peers wait {s['cost_s'] * 1e3:.1f} ms/step"
        )
    if summary.get("advice"):
        lines.append(f"[bold]advice:[/] {summary['advice']}")
    return lines


def summary_line(summary: dict[str, Any], out: Path | None) -> str:
    """The run in one line: step time, MFU, the straggler if any, where the files are, and
    how to get the table."""
    world = summary["world_size"]
    step = summary["phases"]["step"]["median"]
    counted = max((r["steps"] for r in summary["ranks"]), default=0)
    over = f"median of {world} ranks" if world > 1 else "1 rank"
    counts = f"{counted} step{'s' * (counted != 1)}"
    parts = [unmeasured_reason(summary) or f"{_ms(step)} ms/step ({over}, {counts})"]
    mfu = summary.get("mfu") or {}
    if mfu.get("datasheet") is not None:
        parts.append(f"MFU {mfu['datasheet']:.1%} of the datasheet peak")
    elif mfu.get("measured") is not None:
        parts.append(f"MFU {mfu['measured']:.1%} of the measured {summary['peak']['dtype']} peak")
    if summary["stragglers"]:
        s = max(summary["stragglers"], key=lambda x: x["cost_s"])
        parts.append(f"straggler: rank {s['rank']} slow in {s['phase']} ({s['slower']:.2f}x)")
    compiled = compile_line(summary)
    if compiled:
        parts.append(f"{compiled} (not in the step time)")
    if out is not None:
        parts.append(f"ledger in {out / 'observe'} (scaletrain report {out})")
    else:
        parts.append("no files (LedgerConfig(out=RUN) keeps them)")
    return (
        "scaletrain: "
        + "; ".join(parts)
        + ". The phase table: st.init(ledger=st.LedgerConfig(summary='table'))."
    )


def print_line(summary: dict[str, Any], say: Callable[[Any], None], out: Path | None) -> None:
    say(summary_line(summary, out))


def unmeasured_reason(summary: dict[str, Any]) -> str | None:
    """Why no step is in the statistics, where none is: a run of one step has only its
    warm-up (a table of it showed no figure and rank -1)."""
    if max((r["steps"] for r in summary["ranks"]), default=0) > 0:
        return None
    first, last = summary["first_step"], summary["last_step"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    skipped = "warm-up, compiling or profiled" if summary.get("compile") else "warm-up or profiled"
    return (
        f"no step measured: {steps} {'was' if first == last else 'were'} {skipped}, which "
        "the step times leave out (each start's first step is its warm-up); a run of more "
        "steps shows them"
    )


def print_summary(summary: dict[str, Any], say: Callable[[Any], None]) -> None:
    unmeasured = unmeasured_reason(summary)
    say(summary_table(summary) if unmeasured is None else f"where the time goes: {unmeasured}")
    for line in _lines(summary):
        say(line)
