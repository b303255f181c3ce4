"""The ledger on disk: RUN/observe/, its format (version 1), a writer and a reader.

    RUN/observe/rank<r>.jsonl   every rank: one JSON object per line
    RUN/observe/windows.jsonl   rank 0: the cross-rank view of every window
    RUN/observe/summary.json    rank 0: the whole run (phases x ranks, stragglers, MFU...)

Lines of rank<r>.jsonl, told apart by "kind":

- "run" (first line of each start; a resumed run appends another): `v` (format
  version, 1), `rank`, `world_size`, `host`, `pid`, `clock` ("wall" or "cuda"),
  `device`, `device_name`, `backend`, `peer_group`, `every`, `phases` (the names, in the
  order of every step's `p`), `unix` (time.time() at the start).
- "step": `step` (optimizer steps done, this one included), `t` (time.time() at its
  end), `wall` (seconds since the previous step's end), `p` (seconds per phase, in the
  order of `phases`; they add up to `wall`), `cpu` (process CPU seconds, all threads),
  `comm_busy` and `overlap` (seconds some gradient bucket was being reduced, and the
  fraction of it hidden behind backward; null where not timed), `flags` (subset of
  "warmup", "flops", "profiled", "compile": steps the statistics leave out; "compile":
  torch.compile compiled in it, for `p`'s "compile" seconds).
- "memory" (every window): `step`, `allocated_peak`, `reserved_peak` (CUDA bytes, null on
  CPU; the peaks since rt.setup, where CUDA's counters restart), `rss_peak` (bytes), `gpu_util` (percent from NVML, null without it), `rss_setup`
  (the RSS when rt.setup ran; on Linux the peak RSS restarts there, so `rss_peak` is the
  peak since setup and `rss_peak - rss_setup` what training itself added; null where the
  peak could not be restarted, and `rss_peak` is then the process's whole life).
- "flops" (once): `flops_per_step`, `dtype`, `peak_measured`, `peak_datasheet`
  (FLOP/s, null if unknown), `device_name`.
- "profile": `first_step`, `last_step`, `trace`, and the window's overlap numbers.

windows.jsonl and summary.json give, per rank, `cpu_wait` besides the phases: seconds per
step the training thread waited for a CPU (the kernel's run queue; null without /proc);
and `compile_s`, `compile_steps`, `compile_first`, `compile_last`: torch.compile's
seconds over the steps that compiled, how many, the first and the last (0: none).
summary.json's `compile` is the run's (null when nothing compiled). A file written
before the "compile" phase existed reads as 0 compile seconds.

Times are seconds, rounded to the microsecond. `read_run(RUN)` reads it all back;
`phase_medians` and `peak_memory` are what a planner compares its predictions with.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scaletrain.observe.metrics.phases import PHASES

__all__ = [
    "FORMAT_VERSION",
    "OBSERVE_DIR",
    "RankLog",
    "RankRecords",
    "RunRecords",
    "StepRecord",
    "append_window",
    "clean_json",
    "peak_memory",
    "phase_medians",
    "rank_file",
    "read_run",
]

FORMAT_VERSION = 1
OBSERVE_DIR = "observe"
SKIPPED_FLAGS = frozenset({"warmup", "flops", "profiled", "compile"})


def clean_json(value: Any) -> Any:
    """NaN and infinities become null: the files stay strict JSON for any reader."""
    if isinstance(value, float):
        return None if value != value or value in (float("inf"), float("-inf")) else value
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def append_window(run_dir: Path, stats: Any, candidates: list[Any]) -> None:
    """One line of windows.jsonl (rank 0): the window's cross-rank view and this window's
    straggler candidates."""
    record = stats.as_dict()
    record["stragglers"] = [s.as_dict() for s in candidates]
    path = Path(run_dir) / OBSERVE_DIR / "windows.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(clean_json(record)) + "\n")


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / OBSERVE_DIR / f"rank{rank}.jsonl"


def _fmt(x: float | None) -> str:
    """A number in JSON, to the microsecond (0 as 0); null for None and NaN."""
    if x is None or x != x:
        return "null"
    return "0" if x == 0 else f"{x:.6f}"


class RankLog:
    """Appends this rank's lines; flushed every window (not every step)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(
        self,
        step: int,
        t: float,
        wall: float,
        seconds: list[float],
        *,
        cpu: float | None,
        comm_busy: float | None,
        overlap: float | None,
        flags: tuple[str, ...],
    ) -> None:
        # Formatted by hand: json.dumps and round() per number cost ~30 us a step.
        if self._file is None:
            return
        p = ",".join([_fmt(s) for s in seconds])
        extra = (',"flags":["' + '","'.join(flags) + '"]') if flags else ""
        self._file.write(
            f'{{"kind":"step","step":{step},"t":{t:.6f},"wall":{_fmt(wall)},"p":[{p}],'
            f'"cpu":{_fmt(cpu)},"comm_busy":{_fmt(comm_busy)},"overlap":{_fmt(overlap)}'
            f"{extra}}}\n"
        )

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    rank: int
    step: int
    t: float
    wall: float
    phases: dict[str, float]
    cpu: float | None = None
    comm_busy: float | None = None
    overlap: float | None = None
    flags: tuple[str, ...] = ()

    @property
    def counted(self) -> bool:
        """False for steps the statistics leave out (warm-up, FLOP counting, profiled,
        compiling)."""
        return not (SKIPPED_FLAGS & set(self.flags))


@dataclass(slots=True)
class RankRecords:
    rank: int
    header: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    flops: dict[str, Any] | None = None
    profiles: list[dict[str, Any]] = field(default_factory=list)
    first_step: int | None = None
    """The first step its last start recorded (None: it recorded none)."""

    def supersede(self, step: int) -> None:
        """Drop what was recorded from `step` on: a later start trained it again (a run
        resumed from a checkpoint before it)."""
        self.steps = [x for x in self.steps if x.step < step]
        self.memory = [m for m in self.memory if int(m.get("step", 0)) < step]


@dataclass(slots=True)
class RunRecords:
    run_dir: Path
    ranks: dict[int, RankRecords]
    windows: list[dict[str, Any]]
    summary: dict[str, Any] | None

    @property
    def counted(self) -> bool:
        """Whether any rank's statistics counted a step (a run of only its warm-up: no)."""
        return any(s.counted for rr in self.ranks.values() for s in rr.steps)

    def last_start(self) -> RunRecords:
        """The run's last start alone: its ranks (its header's world size) and their
        steps and memory from its first step on."""
        latest = _latest(self.ranks)
        if latest is None:
            return self
        world = int(latest.header.get("world_size") or len(self.ranks))
        ranks = {}
        for rank, rr in self.ranks.items():
            if rank < world:
                first = rr.first_step or 0
                ranks[rank] = dataclasses.replace(
                    rr, steps=[s for s in rr.steps if s.step >= first],
                    memory=[m for m in rr.memory if int(m.get("step", 0)) >= first],
                )  # fmt: skip
        return dataclasses.replace(self, ranks=ranks)


def _latest(ranks: dict[int, RankRecords]) -> RankRecords | None:
    """The rank whose header is the newest (its start the run's last), None if none."""
    return max(ranks.values(), key=lambda rr: float(rr.header.get("unix") or 0), default=None)


def _read_rank(path: Path, rank: int) -> RankRecords:
    out = RankRecords(rank)
    names: list[str] = list(PHASES)
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
            kind = rec.get("kind")
            if kind == "run":
                out.header = rec
                names = list(rec.get("phases", PHASES))
                out.first_step = None
            elif kind == "step":
                if out.first_step is None:
                    # A start's first step: one resumed from an older checkpoint trains
                    # its steps again, and what the start before recorded from there on
                    # is superseded.
                    out.first_step = int(rec["step"])
                    out.supersede(out.first_step)
                phases = {n: float(v or 0.0) for n, v in zip(names, rec["p"], strict=False)}
                out.steps.append(
                    StepRecord(
                        rank=rank,
                        step=int(rec["step"]),
                        t=float(rec["t"]),
                        wall=float(rec["wall"] or 0.0),
                        phases=phases,
                        cpu=rec.get("cpu"),
                        comm_busy=rec.get("comm_busy"),
                        overlap=rec.get("overlap"),
                        flags=tuple(rec.get("flags", ())),
                    )
                )
            elif kind == "memory":
                out.memory.append(rec)
            elif kind == "flops":
                out.flops = rec
            elif kind == "profile":
                out.profiles.append(rec)
    return out


def read_run(run_dir: str | Path) -> RunRecords:
    """Everything the ledger wrote for a run (FileNotFoundError if it wrote nothing)."""
    base = Path(run_dir) / OBSERVE_DIR
    files = sorted(base.glob("rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no ledger files in {base} (rank<r>.jsonl)")
    ranks = {}
    for path in files:
        digits = path.stem.removeprefix("rank")
        if digits.isdigit():
            ranks[int(digits)] = _read_rank(path, int(digits))
    # A later start of fewer ranks leaves the others' files as they were: what they
    # recorded from its first step on is superseded too.
    latest = _latest(ranks)
    if latest is not None and latest.first_step is not None and latest.header.get("unix"):
        world = int(latest.header.get("world_size") or len(ranks))
        for rank, rr in ranks.items():
            if rank >= world:
                rr.supersede(latest.first_step)
    windows = []
    if (base / "windows.jsonl").is_file():
        for line in (base / "windows.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                windows.append(json.loads(line))
    summary = None
    if (base / "summary.json").is_file():
        summary = json.loads((base / "summary.json").read_text(encoding="utf-8"))
    return RunRecords(Path(run_dir), dict(sorted(ranks.items())), windows, summary)


def phase_medians(run: str | Path | RunRecords) -> dict[int, dict[str, float]]:
    """Per rank: the median seconds per step of every phase, and of the whole step
    ("step"), over the steps the statistics count (warm-up, profiled and compiling steps
    out); a rank that counted none is left out (its warm-up is no step's measure)."""
    records = run if isinstance(run, RunRecords) else read_run(run)
    out: dict[int, dict[str, float]] = {}
    for rank, rr in records.ranks.items():
        steps = [s for s in rr.steps if s.counted]
        if not steps:
            continue
        medians = {n: statistics.median(s.phases.get(n, 0.0) for s in steps) for n in PHASES}
        medians["step"] = statistics.median(s.wall for s in steps)
        out[rank] = medians
    return out


def peak_memory(run: str | Path | RunRecords) -> dict[int, dict[str, int | None]]:
    """Per rank: the highest allocated / reserved (CUDA) and RSS bytes recorded, and the
    RSS's growth after setup (its peak less what the process held when training began:
    on a CPU, what training allocated)."""
    records = run if isinstance(run, RunRecords) else read_run(run)
    out: dict[int, dict[str, int | None]] = {}
    for rank, rr in records.ranks.items():
        peaks: dict[str, int | None] = {}
        for key in ("allocated_peak", "reserved_peak", "rss_peak"):
            values = [m[key] for m in rr.memory if m.get(key) is not None]
            peaks[key] = int(max(values)) if values else None
        growths = [m["rss_peak"] - m["rss_setup"] for m in rr.memory
                   if m.get("rss_peak") and m.get("rss_setup")]  # fmt: skip
        peaks["rss_growth"] = int(max(growths)) if growths else None
        out[rank] = peaks
    return out
