"""`scaletrain plan --check RUN`: a finished run's measurements beside the plan's
prediction for the same layout.

A run describes its layout in RUN/config.json and what it measured in RUN/observe/
(the step ledger): the median training work per step on the slowest rank, the RSS
growth after setup, and on a GPU the CUDA peak allocated. The prediction is
scaletrain.train.planning.plan for that layout, measured where the run ran.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.errors import ConfigError, spell
from scaletrain.plan.estimate import Estimate
from scaletrain.plan.layouts import Layout

__all__ = [
    "Check",
    "check_run",
    "layout_of",
    "measured",
    "measured_allocated",
    "measured_cpu",
]


def layout_of(strategy: str, mesh: str | None, world: int) -> Layout:
    """The plan's layout for a run's strategy, mesh and world size."""
    dims = dict(p.split("=") for p in mesh.split(",")) if mesh else {}
    dp, tp, pp = (int(dims.get(k, 1)) for k in ("dp", "tp", "pp"))
    if world == 1:
        return Layout("ddp", dp=1)
    if tp > 1 and dp > 1:
        return Layout("fsdp x tp", dp=dp, tp=tp)
    if pp > 1 and dp > 1:
        return Layout("ddp x pp", dp=dp, pp=pp, schedule="1f1b", microbatches=4)
    if strategy == "tensor":
        return Layout("tensor", tp=world)
    if strategy == "pipeline":
        return Layout("pipeline", pp=world, schedule="1f1b", microbatches=4)
    return Layout(strategy if strategy in ("ddp", "fsdp") else "ddp", dp=world)


@dataclass(frozen=True, slots=True)
class Check:
    """A run's measurement beside the plan's prediction for the same layout."""

    layout: Layout
    predicted: Estimate
    step_s: float
    growth: int | None
    overlap: float | None
    cpu_s: float | None = None
    allocated: int | None = None
    """A GPU run's peak of CUDA allocated bytes (busiest rank): compared with the
    predicted total, not the RSS growth."""

    @property
    def step_error(self) -> float:
        return (self.predicted.time.total - self.step_s) / self.step_s * 100

    @property
    def memory_error(self) -> float | None:
        if self.allocated:
            return (self.predicted.memory.total - self.allocated) / self.allocated * 100
        if not self.growth:
            return None
        return (self.predicted.memory.growth - self.growth) / self.growth * 100

    def table(self) -> str:
        p = self.predicted
        if self.allocated:
            mem = (
                f"{p.memory.total / 2**20:.1f} MiB predicted, {self.allocated / 2**20:.1f} MiB "
                f"measured ({self.memory_error:+.1f}%) (CUDA peak allocated, busiest rank)"
            )
        elif self.growth and self.memory_error is not None:
            mem = (
                f"{p.memory.growth / 2**20:.1f} MiB predicted, {self.growth / 2**20:.1f} MiB "
                f"measured ({self.memory_error:+.1f}%) (growth after setup, busiest rank)"
            )
        else:
            mem = (
                f"{p.memory.growth / 2**20:.1f} MiB predicted, not measured (no rss_setup) "
                "(growth after setup, busiest rank)"
            )
        return "\n".join(
            [
                f"check: {self.layout.label}",
                f"  step time   {p.time.total * 1e3:.1f} ms predicted, {self.step_s * 1e3:.1f} "
                f"ms measured ({self.step_error:+.1f}%)",
                f"  memory      {mem}",
                *(
                    [
                        f"  CPU time    {p.time.cpu * 1e3:.1f} ms predicted, {self.cpu_s * 1e3:.1f} "
                        f"ms measured per step ({(p.time.cpu - self.cpu_s) / self.cpu_s:+.1%})"
                    ]
                    if self.cpu_s and not self.allocated
                    else []
                ),
                "  overlap     "
                + (
                    f"{self.overlap:.0%} of gradient communication hidden (measured, used)"
                    if self.overlap is not None
                    else "not measured by the run: the plan's assumption is used"
                ),
                *([self.too_short] if self.too_short else []),
            ]
        )

    @property
    def too_short(self) -> str:
        """A remark where the run's steps are too short to judge a plan by, else ''."""
        least = TOO_SHORT_GPU if self.allocated else TOO_SHORT
        if self.step_s >= least:
            return ""
        busy = (
            f" (its threads' CPU, {self.cpu_s * 1e3:.1f} ms a step, is more than the "
            "step's wall: it counts the ledger's and the process group's threads too)"
            if self.cpu_s and self.cpu_s > self.step_s and not self.allocated
            else ""
        )
        return (
            f"  note        steps of {self.step_s * 1e3:.1f} ms are too short to judge the "
            "plan by: the process's own fixed costs, not the model's work, set them"
            f"{busy}. Check a run whose steps take {least * 1e3:.0f} ms or more "
            f"(a larger {spell('batch_size')} or model)."
        )


TOO_SHORT = 0.002
"""Seconds of a CPU step below which a check says its errors mean little: here a
split-net step (0.3 ms) read -23% and its memory -34% of a few MiB, while the recipes'
8-270 ms steps read within 20%."""
TOO_SHORT_GPU = 0.001
"""The same on a GPU, where the convnet recipe's 2-3 ms steps on an H200 read within
10% (the host's launches set such steps' pace, not the model's arithmetic)."""


_NOT_PLANNED = ("data", "h2d", "checkpoint", "eval", "compile")
"""Ledger phases the plan does not predict: the input pipeline, saving, evaluating,
compiling."""


def measured(run: str | Path) -> tuple[float, int | None, float | None]:
    """(median seconds of training work per step on the slowest rank, RSS growth after
    setup on the largest rank, median hidden fraction of gradient communication) from
    RUN/observe/. Training work is the step's wall time less its data, h2d, checkpoint,
    eval and compile phases (what the plan predicts)."""
    from scaletrain.observe.records import read_run

    records = read_run(run)
    work: list[float] = []
    growths: list[int] = []
    overlaps: list[float] = []
    for rr in records.ranks.values():
        steps = [s for s in rr.steps if s.counted] or rr.steps
        if steps:
            work.append(
                statistics.median(
                    s.wall - sum(s.phases.get(p, 0.0) for p in _NOT_PLANNED) for s in steps
                )
            )
        for m in rr.memory:
            if m.get("rss_setup") and m.get("rss_peak"):
                growths.append(int(m["rss_peak"]) - int(m["rss_setup"]))
        overlaps += [s.overlap for s in steps if s.overlap is not None]
    if not work:
        raise ConfigError(
            f"{spell('check', str(run))}: the run's ledger (RUN/observe/) holds no step. "
            "Fix: a run trained with the ledger on (the default) for some steps.",
            field="check",
        )
    growth = max(growths) if growths else None
    return max(work), growth, (statistics.median(overlaps) if overlaps else None)


def measured_allocated(run: str | Path) -> int | None:
    """A GPU run's peak of CUDA allocated bytes on its busiest rank (the ledger's
    allocated_peak, which is never restarted: its last record is the run's peak); None
    for a CPU run."""
    from scaletrain.observe.records import read_run

    peaks = [
        int(m["allocated_peak"])
        for rr in read_run(run).ranks.values()
        for m in rr.memory
        if m.get("allocated_peak")
    ]
    return max(peaks) if peaks else None


def measured_cpu(run: str | Path) -> float | None:
    """Median CPU seconds per step (all threads of the process) of the busiest rank."""
    from scaletrain.observe.records import read_run

    per_rank = []
    for rr in read_run(run).ranks.values():
        cpus = [s.cpu for s in rr.steps if s.counted and s.cpu is not None]
        if cpus:
            per_rank.append(statistics.median(cpus))
    return max(per_rank) if per_rank else None


def check_run(run: str | Path) -> Check:
    """Predict the run's own layout (its config.json) and compare with its ledger."""
    base = Path(run)
    config = base / "config.json"
    if not config.is_file() or not (base / "observe").is_dir():
        raise ConfigError(
            f"{spell('check', str(run))} is not a finished run with a ledger: expected "
            f"{config} and {base / 'observe'}/. Fix: the --out directory of a "
            "`scaletrain train` run (ledger on, the default).",
            field="check",
        )
    cfg = json.loads(config.read_text(encoding="utf-8"))
    world = int(cfg.get("run", {}).get("world_size", cfg.get("nproc") or 1))
    step, growth, overlap = measured(base)
    allocated = measured_allocated(base)
    if allocated and world > 1:
        which = f"--model {cfg['model']}" if cfg.get("model") else f"--recipe {cfg.get('recipe')}"
        raise ConfigError(
            f"{spell('check', str(run))} trained on {world} GPUs: a measured check covers "
            "runs of one GPU (a plan of several would need NCCL, which the probe does not "
            f"run). Its layouts on paper: scaletrain plan {which} "
            f"--devices {world} --hardware h100-sxm (or another profile).",
            field="check",
        )
    if allocated and not torch.cuda.is_available():
        raise ConfigError(
            f"{spell('check', str(run))} trained on a GPU (its ledger holds CUDA memory), "
            "and this machine has none: its plan would be of this CPU. Fix: run the check "
            "on a machine with the run's GPU.",
            field="check",
        )
    layout = layout_of(cfg.get("strategy", "ddp"), cfg.get("mesh"), world)
    # Measured where the run ran: a CPU run on a GPU machine is planned on its CPU.
    from scaletrain.train.planning import plan

    model = cfg.get("model")
    result = plan(
        None if model else cfg.get("recipe"), model=model, devices=world,
        batch_size=int(cfg["batch_size"]),
        precision=str(cfg.get("precision", "32")), overlap=overlap, layouts=[layout],
        device="cuda" if allocated else "cpu",
        ac=str(cfg.get("ac", "none")), ac_every=cfg.get("ac_every"),
    )  # fmt: skip
    return Check(
        layout, result.rows[0], step, growth, overlap, measured_cpu(base), allocated=allocated
    )
