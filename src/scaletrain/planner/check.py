"""`scaletrain plan --check RUN`: a finished run's measurements beside `plan`'s
prediction for its own layout (RUN/config.json) on a hardware file (the one given,
else this machine's calibration).

From the run's step ledger (RUN/observe/): the training work per step on the slowest
rank (its median step less the medians of the phases a plan does not predict), and memory on
the busiest rank: on a GPU the CUDA peak allocated, which the plan's peak predicts;
on a CPU the RSS growth after setup (the peak less the parameters that existed before).
A run is checked on a hardware file of the device it trained on (its ledger's `device`):
a CPU run's step priced on an H100 says nothing of either.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, spell
from scaletrain.hardware import Hardware, load
from scaletrain.hardware.calibrate import calibrated_path, load_calibrated
from scaletrain.observe.metrics.ledger import EARLY_WINDOWS, LedgerConfig
from scaletrain.observe.metrics.records import (
    OBSERVE_DIR,
    RunRecords,
    peak_memory,
    phase_medians,
    read_run,
)
from scaletrain.planner.api import Plan, plan
from scaletrain.planner.cost import Estimate
from scaletrain.planner.layout import Layout

__all__ = ["Check", "check_run", "layout_of", "measured"]

NOT_MEASURED = "not measured by the run"

ONE_PROCESS = {
    "dp": "DataParallel: one process driving every GPU",
    "model-parallel": "one process, its layers placed over the devices",
}
"""Strategies of one process over several devices, which no row of a plan is."""

NOT_PLANNED = ("data", "h2d", "checkpoint", "eval", "compile")
"""Ledger phases a plan does not predict (input pipeline, saving, evaluating, compiling)."""


def layout_of(strategy: str, mesh: str | None, world: int) -> Layout:
    """The plan's layout for a run's strategy, mesh and world size."""
    dims = dict(p.split("=") for p in mesh.split(",")) if mesh else {}
    dp, tp, pp = (int(dims.get(k, 1)) for k in ("dp", "tp", "pp"))
    if world == 1:
        return Layout("ddp")
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
    """A run's measurements beside the plan's prediction for the same layout."""

    layout: Layout
    predicted: Estimate
    step_s: float
    memory: int | None
    on_gpu: bool
    plan: Plan | None = None
    """The plan made for the run's layout: what its header names."""
    no_memory: str = NOT_MEASURED
    """What the memory line says where the run measured none (`_no_memory`)."""

    @property
    def predicted_memory(self) -> float:
        m = self.predicted.memory
        return m.total if self.on_gpu else m.total - m.params - m.buffers

    def table(self) -> str:
        p, mem = self.predicted.time.total, self.predicted_memory
        what = "CUDA peak allocated" if self.on_gpu else "RSS growth after setup"
        got = (
            f"{self.memory / 2**20:.1f} MiB measured ({(mem - self.memory) / self.memory:+.1%}) "
            f"({what}, busiest rank)"
            if self.memory
            else self.no_memory
        )
        planned = f" (the run's layout) for {self.plan.planned()}" if self.plan else ""
        return (
            f"check: {self.layout.label}{planned}\n"
            f"  step time   {p * 1e3:.1f} ms predicted, {self.step_s * 1e3:.1f} ms measured "
            f"({(p - self.step_s) / self.step_s:+.1%})\n"
            f"  memory      {mem / 2**20:.1f} MiB predicted, {got}"
        )


def measured(run: str | Path, records: RunRecords | None = None) -> tuple[float, int | None, bool]:
    """(seconds of training work per step, memory, whether that is a GPU's) from
    RUN/observe/ (`records`: what `_records` read of it), as the module docstring says."""
    # The plan is made for config.json's layout, the last start's: an earlier start at
    # another world size is another layout.
    records = (records or _records(run)).last_start()
    medians = phase_medians(records).values()
    if not any(rr.steps for rr in records.ranks.values()):
        raise ConfigError(
            f"{spell('check', str(run))}: the run's ledger (RUN/observe/) holds no step. "
            "Fix: a run trained with the ledger on (the default) for some steps.",
            field="check",
        )
    if not medians:  # a 1-step run: its warm-up, which is no step's measure
        raise ConfigError(
            f"{spell('check', str(run))}: the run's ledger counts no step of its last start "
            "(the layout its config.json describes): each was warm-up, compiling or "
            "profiled, which the step times leave out (each start's first step is its "
            "warm-up). Fix: a start of at least 2 steps (--max-steps), better 20 or more.",
            field="check",
        )
    work = max(m["step"] - sum(m[p] for p in NOT_PLANNED) for m in medians)
    peaks = peak_memory(records).values()
    if allocated := [p["allocated_peak"] for p in peaks if p["allocated_peak"]]:
        return work, max(allocated), True
    return work, max((p["rss_growth"] for p in peaks if p["rss_growth"]), default=None), False


def _records(run: str | Path) -> RunRecords:
    """What the run's ledger wrote: none where observe/ holds no rank's file (a run
    killed before the ledger's first line), which `measured` refuses as no step."""
    try:
        return read_run(run)
    except FileNotFoundError:
        return RunRecords(Path(run), {}, [], None)


def _is_run(path: Path) -> bool:
    """Whether `path` is a run's directory with a ledger (its config.json and observe/)."""
    return (path / "config.json").is_file() and (path / OBSERVE_DIR).is_dir()


def _not_a_run(run: str | Path) -> ConfigError:
    """The refusal of a --check path that is no run's directory: a file or directory
    inside one (RUN/config.json) is pointed to the run it is in."""
    base, what = Path(run), spell("check", str(run))
    home = next((p for p in base.absolute().parents if _is_run(p)), None) if base.exists() else None
    if home is not None:
        kind = "file" if base.is_file() else "directory"
        return ConfigError(
            f"{what} is a {kind} inside the run {home}, not a run: {spell('check')} takes a "
            f"run's directory (the --out of `scaletrain train`). Fix: "
            f"{spell('check', str(home))}.",
            field="check",
        )
    found = "is a file, not a finished run" if base.is_file() else (
        f"is not a finished run with a ledger: expected {base / 'config.json'} and "
        f"{base / OBSERVE_DIR}/"
    )  # fmt: skip
    return ConfigError(
        f"{what} {found}. Fix: the --out directory of a `scaletrain train` run (ledger on, "
        "the default).",
        field="check",
    )


def _device(records: RunRecords, config: dict[str, Any]) -> str | None:
    """The device type the run trained on ("cuda", "cpu"): its ledger's, else its
    config.json's; None where neither says."""
    said = [rr.header.get("device") for rr in records.ranks.values()]
    said.append((config.get("run") or {}).get("device"))
    return next((str(d).split(":")[0] for d in said if d), None)


def _refuse_other_device(run: str | Path, device: str, hardware: str | None, hw: Hardware) -> None:
    """Refuse a hardware file of another device than the run's: it predicts another
    machine's step, which says nothing of the run's (a CPU run's step priced on an H100)."""
    if hardware is not None:
        named = f"{spell('hardware', hardware)} is a {hw.device} machine ({hw.description})"
        fix = (
            f"the hardware file of the machine the run trained on ({spell('hardware')} FILE); "
            f"if it trained on this machine, its calibration: `scaletrain plan "
            f"{spell('calibrate')}`, then {spell('check')} RUN without {spell('hardware')}"
        )
    else:
        named = f"this machine's calibration ({calibrated_path()}) is a {hw.device} machine's"
        fix = (
            f"{spell('hardware')} FILE, the hardware file of the machine the run trained on "
            f"(`scaletrain plan {spell('calibrate')} FILE` writes it there)"
        )
    raise ConfigError(
        f"{spell('check', str(run))}: the run trained on {device}, but {named}: its "
        f"prediction would be another machine's. Expected: the hardware file of a {device} "
        f"machine, the one the run trained on. Fix: {fix}.",
        field="hardware",
    )


def _no_memory(records: RunRecords) -> str:
    """Why the run's ledger holds no memory figure: a ledger writes one as a window
    closes, at a start's steps 10 and 20 (EARLY_WINDOWS) and every `every` steps, so a
    start of fewer steps has none."""
    ranks = records.ranks.values()
    if not ranks or any(rr.memory for rr in ranks):
        return NOT_MEASURED
    every = max(int(rr.header.get("every") or LedgerConfig().every) for rr in ranks)
    start = {id(rr): int(rr.header.get("start_step") or 0) for rr in ranks}
    trained = max(sum(s.step > start[id(rr)] for s in rr.steps) for rr in ranks)
    if trained >= min(EARLY_WINDOWS[0], every):  # long enough: the ledger lost it
        return NOT_MEASURED
    return (
        f"{NOT_MEASURED}: its ledger records memory as a window closes, at steps "
        f"{' and '.join(map(str, EARLY_WINDOWS))} of a start and every {every} "
        f"({spell('ledger_every')}), and the run's last start trained {trained} step(s). "
        f"Fix: train at least {min(EARLY_WINDOWS[0], every)} steps in one start"
    )


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 lacks."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def check_run(run: str | Path, hardware: str | None = None) -> Check:
    """Predict the run's own layout (its config.json) and compare with its ledger."""
    from scaletrain.train.hf_config import config_file
    from scaletrain.train.model_module import load_recipe

    base = Path(run)
    if not _is_run(base):
        raise _not_a_run(run)
    cfg = json.loads((base / "config.json").read_text(encoding="utf-8"))
    records = _records(base)
    given = hardware
    if hardware is not None and Path(hardware).is_file():
        hardware = str(Path(hardware).resolve())  # before the move to the run's directory
    hw = load(hardware) if hardware is not None else load_calibrated(paper=False)
    if (device := _device(records, cfg)) and device != hw.device:
        _refuse_other_device(run, device, given, hw)
    if cfg.get("float8") and hw.fp8_flops() is None:
        raise ConfigError(
            f"{spell('check', str(run))}: the run trained with {spell('float8', True)}, and "
            f"{hw.name}'s hardware file gives no fp8 FLOP/s to plan its float8 matmuls with. "
            "Fix: the hardware file of the GPUs it trained on, with `fp8 = ...` (their "
            "achieved float8 FLOP/s) in its [flops] table where it has none.",
            field="hardware",
        )
    world = int(cfg.get("run", {}).get("world_size", cfg.get("nproc") or 1))
    if (strategy := cfg.get("strategy")) in ONE_PROCESS:
        raise ConfigError(
            f"{spell('check', str(run))}: the run trained with --strategy {strategy} "
            f"({ONE_PROCESS[strategy]}), and a plan's rows are one process per device: "
            "none is that run's layout. Fix: check a run of ddp, fsdp, tensor, pipeline or "
            "a mesh (--strategy single is `ddp dp=1`'s one device).",
            field="check",
        )
    step, memory, on_gpu = measured(base, records)
    no_memory = _no_memory(records) if memory is None else NOT_MEASURED
    layout = layout_of(cfg.get("strategy", "ddp"), cfg.get("mesh"), world)
    model = cfg.get("model")
    # The model (and data) module as the run named it: a relative path or module name is
    # the run's directory's, where it was started.
    started = cfg.get("run", {}).get("directory")
    here = started if model and started and Path(started).is_dir() else os.getcwd()
    try:
        with _working_directory(here):
            seq_len = None
            if model and config_file(model) is not None:
                # A config.json run trained at its recipe's sequence (or its data's), not
                # at the longer one a plan of a config.json assumes.
                seq_len = int(load_recipe(model, data=cfg.get("data")).example(1)[0].shape[1])
            result = plan(
                None if model else cfg.get("recipe"), model=model, devices=world,
                hardware=hardware, batch_size=int(cfg["batch_size"]), seq_len=seq_len,
                accumulate=int(cfg.get("accumulate") or 1),
                precision=str(cfg.get("precision", "32")),
                ac=str(cfg.get("ac", "none")), ac_every=cfg.get("ac_every"),
                compile=bool(cfg.get("compile", False)), float8=bool(cfg.get("float8", False)),
                layouts=[layout],
            )  # fmt: skip
    except ConfigError as exc:
        if exc.field not in ("model", "data"):
            raise
        raise ConfigError(
            f"{spell('check', str(run))}: the model its config.json names could not be built "
            f"in {here}{'' if started else ' (the run does not say where it was started)'}: "
            f"{exc}",
            field="check",
        ) from None
    return Check(layout, result.rows[0], step, memory, on_gpu, result, no_memory)
