"""`scaletrain report RUN`: RUN/report.html, one self-contained page about where the time went.

Made with plotly's offline HTML: plotly.js is inlined once, so the page opens without a
network (no script from a CDN). Sections: the run's facts and advice; the per-rank
stacked step breakdown; step time per rank over the run (the straggler view); overlap
per rank (the ledger's, and the profile window's by HTA's definition); throughput;
loss and learning rate; MFU; memory. Sections without data say so instead of plotting.
"""

from __future__ import annotations

import html
import json
import os
import statistics
from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError, say
from scaletrain.observe.metrics.phases import PHASE_DOCS, PHASES
from scaletrain.observe.metrics.records import OBSERVE_DIR, RunRecords, peak_memory, read_run
from scaletrain.observe.metrics.stragglers import what_slowed
from scaletrain.observe.metrics.summary import compile_line, unmeasured_reason

__all__ = ["ReportError", "write_report"]

_COLORS = {
    "data": "#e45756",
    "h2d": "#ff9da6",
    "forward": "#4c78a8",
    "backward": "#72b7b2",
    "comm": "#f58518",
    "optimizer": "#54a24b",
    "sync": "#b279a2",
    "checkpoint": "#9d755d",
    "eval": "#bab0ac",
    "other": "#d3d3d3",
    "compile": "#eeca3b",
}
MAX_POINTS = 1500
"""Points per rank in the step-time plot (longer runs are binned: median per bin)."""


class ReportError(ScaletrainError):
    """The run directory holds nothing to report on, or plotly is missing."""


def _metrics(run: Path) -> list[dict[str, Any]]:
    """RUN/metrics.jsonl's records, less those a start resumed from an older checkpoint
    trained again (its first train record's step, and every later one, supersede
    what the start before recorded from that step on)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out: list[dict[str, Any]] = []
    last = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, int):
            if rec.get("event") == "train" and step <= last:  # a step trained again
                out = [r for r in out if not (isinstance(r.get("step"), int) and r["step"] >= step)]
                last = step
            last = max(last, step)
        out.append(rec)
    return out


def _rank_means(records: RunRecords) -> dict[int, dict[str, float]]:
    """Mean seconds per phase per step, per rank (summary.json's when there is one)."""
    if records.summary:
        return {
            r["rank"]: {**r["phases"], "step": r["step"]}
            for r in records.summary["ranks"]
            if r.get("step") is not None
        }
    out = {}
    for rank, rr in records.ranks.items():
        steps = [s for s in rr.steps if s.counted] or rr.steps
        if steps:
            means = {n: statistics.fmean(s.phases.get(n, 0.0) for s in steps) for n in PHASES}
            means["step"] = statistics.fmean(s.wall for s in steps)
            out[rank] = means
    return out


def _binned(xs: list[int], ys: list[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= MAX_POINTS:
        return [float(x) for x in xs], ys
    size = -(-len(xs) // MAX_POINTS)
    bx, by = [], []
    for i in range(0, len(xs), size):
        bx.append(statistics.median(xs[i : i + size]))
        by.append(statistics.median(ys[i : i + size]))
    return bx, by


def _figures(records: RunRecords, metrics: list[dict[str, Any]]) -> list[tuple[str, Any, str]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figs: list[tuple[str, Any, str]] = []
    summary = records.summary or {}
    # A run of only its warm-up step has no step to show: the step sections say why
    # (summary.json is its last start's; an earlier start's steps are still drawn).
    why = unmeasured_reason(summary) if summary.get("ranks") and not records.counted else None
    unmeasured = f"{why[0].upper()}{why[1:]}." if why else ""
    means = _rank_means(records)
    ranks = sorted(means)
    labels = [f"rank {r}" for r in ranks]
    layout = {"template": "plotly_white", "height": 380, "margin": {"t": 40, "b": 40}}

    fig = go.Figure()
    for name in PHASES:
        values = [means[r].get(name, 0.0) * 1e3 for r in ranks]
        if any(v > 0 for v in values):
            fig.add_bar(name=name, x=labels, y=values, marker_color=_COLORS[name],
                        hovertemplate=f"{name}: %{{y:.2f}} ms<extra>{html.escape(PHASE_DOCS[name])}</extra>")  # fmt: skip
    fig.update_layout(barmode="stack", yaxis_title="ms per step (mean)", **layout)
    figs.append(("Step breakdown per rank", fig, unmeasured or "Where each rank's step goes; "
                 "the bars' heights are the mean step time. A taller bar is a slower rank."))  # fmt: skip

    fig = go.Figure()
    for rank, rr in records.ranks.items():
        steps = [s for s in rr.steps if s.counted]
        if steps:
            x, y = _binned([s.step for s in steps], [s.wall * 1e3 for s in steps])
            fig.add_scatter(name=f"rank {rank}", x=x, y=y, mode="lines")
    fig.update_layout(xaxis_title="step", yaxis_title="step time (ms)", **layout)
    figs.append(("Step time per rank over the run", fig, unmeasured or "The straggler view: a "
                 "rank whose line sits above the others is slow; spikes are checkpoints and "
                 "evaluations (steps that compiled are left out, as the warm-up step)."))  # fmt: skip

    fig = go.Figure()
    ledger_overlap = [
        statistics.median([s.overlap for s in records.ranks[r].steps if s.overlap is not None] or [float("nan")])
        for r in ranks
    ]  # fmt: skip
    exposed = [means[r].get("comm", 0.0) * 1e3 for r in ranks]
    fig.add_bar(
        name="overlap (ledger, median per step)", x=labels, y=[v * 100 for v in ledger_overlap]
    )
    profile = records.run_dir / "traces" / "overlap.json"
    if profile.is_file():
        data = json.loads(profile.read_text(encoding="utf-8"))
        by_rank = {e["rank"]: e for e in data.get("ranks", [])}
        fig.add_bar(
            name=f"overlap (profile, steps {data['first_step']}-{data['last_step']}, HTA)",
            x=labels,
            y=[(by_rank.get(r, {}).get("overlap") or 0) * 100 for r in ranks],
        )
    fig.add_scatter(name="exposed comm (ms/step)", x=labels, y=exposed, yaxis="y2", mode="markers",
                    marker={"size": 12, "symbol": "diamond"})  # fmt: skip
    fig.update_layout(
        yaxis={"title": "% of communication hidden", "range": [0, 105]},
        yaxis2={
            "title": "exposed ms per step",
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
        },
        barmode="group",
        **layout,
    )
    figs.append(("Overlap of communication with compute", fig, unmeasured or "How much of "
                 "the gradient all-reduce ran while backward was computing; the rest is exposed."))  # fmt: skip

    fig = go.Figure()
    train = [m for m in metrics if m.get("event") == "train"]
    if train:
        fig.add_scatter(
            name="samples/s", x=[m["step"] for m in train], y=[m["samples_per_s"] for m in train]
        )
        fig.update_layout(yaxis_title="samples/s (all ranks)", xaxis_title="step", **layout)
    else:
        steps = [s for s in records.ranks[min(records.ranks)].steps if s.counted]
        x, y = _binned([s.step for s in steps], [1.0 / s.wall if s.wall else 0.0 for s in steps])
        fig.add_scatter(name="steps/s", x=x, y=y)
        fig.update_layout(yaxis_title="steps/s (rank 0)", xaxis_title="step", **layout)
    figs.append(
        ("Throughput", fig, "From metrics.jsonl (scaletrain train), else the ledger's steps/s.")
    )

    if train:
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        fig.add_scatter(
            name="loss (train)", x=[m["step"] for m in train], y=[m["loss"] for m in train]
        )
        evals = [m for m in metrics if m.get("event") == "eval"]
        if evals:
            fig.add_scatter(name="val_loss", x=[m["step"] for m in evals], y=[m["val_loss"] for m in evals],
                            mode="markers+lines")  # fmt: skip
        fig.add_scatter(name="lr", x=[m["step"] for m in train], y=[m["lr"] for m in train],
                        secondary_y=True, line={"dash": "dot"})  # fmt: skip
        fig.update_layout(xaxis_title="step", **layout)
        fig.update_yaxes(title_text="loss", secondary_y=False)
        fig.update_yaxes(title_text="learning rate", secondary_y=True)
        figs.append(("Loss and learning rate", fig, ""))

    mfu_ranks = [r for r in summary.get("ranks", []) if r.get("mfu")]
    if mfu_ranks:
        fig = go.Figure()
        mfu_x = [f"rank {r['rank']}" for r in mfu_ranks]
        fig.add_bar(
            name="vs measured peak",
            x=mfu_x,
            y=[(r["mfu"]["mfu_measured"] or 0) * 100 for r in mfu_ranks],
        )
        if any(r["mfu"].get("mfu_datasheet") is not None for r in mfu_ranks):
            fig.add_bar(name="vs datasheet peak", x=mfu_x,
                        y=[(r["mfu"]["mfu_datasheet"] or 0) * 100 for r in mfu_ranks])  # fmt: skip
        fig.update_layout(yaxis_title="MFU (%)", barmode="group", **layout)
        figs.append(("MFU", fig, _mfu_note(summary)))

    peaks = peak_memory(records)
    # The ledger writes memory as a window closes (not in a start of under 10 steps);
    # the summary has each rank's peak over the whole start, as the console printed it.
    for r in summary.get("ranks", []):
        mine = peaks.setdefault(r["rank"], {})
        for key in ("allocated_peak", "reserved_peak", "rss_peak"):
            known = [v for v in (mine.get(key), r.get(key)) if v is not None]
            mine[key] = int(max(known)) if known else None
    fig = go.Figure()
    mem_ranks = sorted(peaks)
    for key, name in (
        ("allocated_peak", "CUDA allocated"),
        ("reserved_peak", "CUDA reserved"),
        ("rss_peak", "RSS"),
    ):
        mem = [peaks[r][key] for r in mem_ranks]
        if any(v is not None for v in mem):
            fig.add_bar(
                name=name, x=[f"rank {r}" for r in mem_ranks], y=[(v or 0) / 2**20 for v in mem]
            )
    fig.update_layout(yaxis_title="peak MiB", barmode="group", **layout)
    figs.append(
        (
            "Memory per rank",
            fig,
            "Peaks over the run (CUDA allocator on GPUs; resident set size of the process everywhere).",
        )
    )
    return figs


def _mfu_note(summary: dict[str, Any]) -> str:
    peak = summary.get("peak", {})
    mfu = summary.get("mfu") or {}
    parts = [
        f"Peak in {peak.get('dtype')}: measured {(peak.get('measured') or 0) / 1e12:.3f} TFLOP/s"
    ]
    if peak.get("datasheet"):
        parts.append(f"datasheet {peak['datasheet'] / 1e12:.1f} TFLOP/s")
    else:
        parts.append(f"no datasheet peak for {summary.get('device_name')} (never another device's)")
    if mfu.get("error"):
        parts.append(f"MEASUREMENT ERROR: {mfu['error']}")
    return "; ".join(parts) + "."


def _facts(records: RunRecords) -> str:
    s = records.summary
    header = records.ranks[min(records.ranks)].header
    rows = [
        ("run", str(records.run_dir)),
        ("ranks", str(header.get("world_size", len(records.ranks)))),
        ("device", f"{header.get('device_name', '?')} ({header.get('clock', '?')} clock)"),
    ]
    if s:
        rows.append(("steps", f"{s['first_step']}-{s['last_step']}"))
        median = s["phases"]["step"]["median"]
        shown = "-" if median is None else f"{median * 1e3:.2f} ms"
        why = unmeasured_reason(s)
        if why and records.counted:
            why = f"the last start's: {why}"  # summary.json is its; earlier ones measured
        rows.append(("median step", why or shown))
        compiled = compile_line(s)
        if compiled:
            rows.append(
                ("torch.compile", f"{compiled.removeprefix('compile ')} (not in the step times)")
            )
        for st in s.get("stragglers", []):
            rows.append(("straggler", f"rank {st['rank']} {what_slowed(st)}"))
        if s.get("advice"):
            rows.append(("advice", s["advice"]))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='facts'>{body}</table>"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write RUN/report.html (or `out`) from the ledger's files; return its path."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(
            f"{run} is not a directory. Expected a run directory (--out of scaletrain train)."
        )
    try:
        records = read_run(run)
    except FileNotFoundError:
        raise ReportError(
            f"{run}/{OBSERVE_DIR}/ holds no ledger files (rank<r>.jsonl). Expected the run "
            "directory of `scaletrain train` (ledger on), or of a script started with "
            "st.init(ledger=st.LedgerConfig(out=RUN))."
        ) from None
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ReportError(
            "scaletrain report draws with plotly, which is not installed. Fix: "
            "pip install 'scaletrain[report]' (or pip install plotly)."
        ) from None
    target = _target(run, out)
    parts = []
    for i, (title, fig, note) in enumerate(_figures(records, _metrics(run))):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
        note_html = f"<p class='note'>{html.escape(note)}</p>" if note else ""
        parts.append(f"<section><h2>{html.escape(title)}</h2>{note_html}{div}</section>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>scaletrain report: {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} h2{{margin-top:1.5em}}
table.facts th{{text-align:left;padding-right:1em}} .note{{color:#555}}</style></head>
<body><h1>scaletrain report</h1>{_facts(records)}{"".join(parts)}</body></html>
"""
    target.write_text(page, encoding="utf-8")
    return target


def _target(run: Path, out: str | Path | None) -> Path:
    """Where the report goes: RUN/report.html, `out`, or report.html in the directory
    `out` names. Refused, before any figure is drawn: a directory that is not there, and
    a file that is not a report of ours (writing would replace what the user saved)."""
    if out is None:
        return run / "report.html"
    given = Path(out)
    folder = given.is_dir() or str(out).endswith(("/", os.sep))  # "runs/new/": a directory
    target = given / "report.html" if folder else given
    named = say(api=f"write_report(..., out={str(out)!r})", cli=f"--output {out}")
    if not target.parent.is_dir():
        raise ReportError(
            f"{named}: the directory {target.parent} does not exist. Fix: create it first "
            "(mkdir -p), or give a file in a directory that exists."
        )
    if target.exists() and not _ours(target):
        raise ReportError(
            f"{named}: {target} exists and is not a scaletrain report: writing the report "
            "would replace it. Fix: another file name, or move that file away first."
        )
    return target


def _ours(path: Path) -> bool:
    """Whether `path` is a report this module wrote (its title says so)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return "<title>scaletrain report: " in f.read(4096)
    except OSError:
        return False
