"""A torch.profiler window over chosen steps on every rank, and what is read from it.

`scaletrain train --profile 10-15` or `rt.profile("10-15")`:

- every rank records steps 10 to 15 (a ProfilerStep#N span per step) into
  RUN/traces/rank<r>_<host>_<pid>.<time_ns>.pt.trace.json.gz: the names of
  `tensorboard_trace_handler`, which TensorBoard's profiler plugin reads (RUN/traces is
  one "run" of it, each rank a worker); rank, host and pid in the name mean no two ranks
  or nodes ever write the same file (Lightning's ranks overwrite each other's);
- at the window's end every rank computes its overlap of communication with compute
  from its own trace (scaletrain.observe.metrics.overlap, HTA's definitions), and rank 0 writes
  all of them to RUN/traces/overlap.json;
- after the run rank 0 merges the traces into RUN/traces/merged.json.gz, each rank a
  process track of its own ("rank r"), on one time axis (traces carry wall-clock
  timestamps; ranks on other hosts are shifted by their clock's offset, measured when
  the window opened: every rank read its clock right after one all-gather), and says
  in one line where the traces are and the overlap they measured.

Kineto writes `USDT: ... profiler_start` / `profiler_stop` to the process's stderr
(file descriptor 2) at every start and stop, whatever KINETO_LOG_LEVEL says: the two
calls run with that descriptor on a temporary file, and what else was written there
meanwhile (its warnings, another thread's lines) is passed on.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, say, spell
from scaletrain.observe.metrics.overlap import analyze_trace, load_trace

__all__ = [
    "MAX_PROFILE_STEPS",
    "ProfileWindow",
    "arm_profile",
    "merge_traces",
    "parse_steps",
    "window_past_end",
]

MAX_PROFILE_STEPS = 50
"""Traces grow with every step: a window is kept short."""
TRACES_DIR = "traces"


def window_past_end(window: str | tuple[int, int], total: int) -> ConfigError:
    """The error for a profile window whose first step is past the run's last."""
    return ConfigError(
        f"{spell('profile', window)}: this run has {total} steps, so the window would "
        f"never open. Fix: a window inside the run, e.g. "
        f"{spell('profile', f'{max(1, total - 2)}-{total}')}.",
        field="profile",
    )


def parse_steps(value: str | tuple[int, int]) -> tuple[int, int]:
    """ "10-15" (or (10, 15), or "12" for one step) -> (10, 15), checked."""
    text = value if isinstance(value, str) else "-".join(map(str, value))
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    first = int(match.group(1)) if match else 0
    last = int(match.group(2) or match.group(1)) if match else 0
    if not match or first < 1 or last < first:
        raise ConfigError(
            f"{spell('profile', value)}: expected a window of steps FIRST-LAST with "
            f"1 <= FIRST <= LAST, such as 10-15. Fix: pass e.g. {spell('profile', '10-15')}.",
            field="profile",
        )
    if last - first + 1 > MAX_PROFILE_STEPS:
        raise ConfigError(
            f"{spell('profile', value)} asks for {last - first + 1} steps: expected at most "
            f"{MAX_PROFILE_STEPS} (a trace grows with every step and every rank writes one). "
            f"Fix: a shorter window, e.g. {spell('profile', f'{first}-{first + 5}')}.",
            field="profile",
        )
    return first, last


def arm_profile(
    ledger: Any, steps: str | tuple[int, int], out: Any, *, rank: int, world_size: int
) -> ProfileWindow:
    """Arm a window on `ledger` (the Runtime's)."""
    first, last = parse_steps(steps)
    if ledger is None:
        raise ConfigError(
            say(
                api="rt.profile() needs the step ledger, which this run turned off "
                "(st.init(ledger=False) or SCALETRAIN_LEDGER=0). Fix: leave the ledger on.",
                cli="--profile needs the step ledger, which --no-ledger turned off. Fix: drop "
                "--no-ledger.",
            ),
            field="profile",
        )
    base = Path(out) if out is not None else ledger.out
    if base is None:
        raise ConfigError(
            "rt.profile() has nowhere to write its traces: the ledger has no run directory. "
            "Fix: rt.profile('10-15', out='runs/x'), or st.init(ledger=st.LedgerConfig("
            "out='runs/x')).",
            field="profile",
        )
    if ledger.step >= first:
        raise ConfigError(
            f"{spell('profile', f'{first}-{last}')}: this run is already at step "
            f"{ledger.step}. Fix: a window after it, e.g. "
            f"{spell('profile', f'{ledger.step + 1}-{ledger.step + last - first + 1}')}.",
            field="profile",
        )
    window = ProfileWindow(first, last, base / TRACES_DIR, rank=rank, world_size=world_size)
    ledger.profile = window
    return window


_KINETO_CHATTER = re.compile(
    rb"^(?:USDT|STAGE|INFO|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] "
)
"""Kineto's progress lines (its warnings and errors are kept)."""


@contextlib.contextmanager
def _without_kineto_chatter() -> Iterator[None]:
    """Run the block with fd 2 on a temporary file; then write back what is not
    kineto's progress chatter. Where fd 2 cannot be duplicated, nothing is changed."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line for line in caught.read().splitlines(True) if not _KINETO_CHATTER.match(line)
            ]
            if kept:
                with contextlib.suppress(OSError):
                    os.write(2, b"".join(kept))


def _worker_name(rank: int) -> str:
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f"rank{rank}_{host}_{os.getpid()}"


class ProfileWindow:
    """Starts and stops torch.profiler at step boundaries (driven by the ledger)."""

    def __init__(self, first: int, last: int, out: Path, *, rank: int, world_size: int) -> None:
        self.first, self.last, self.out = first, last, out
        self.rank, self.world_size = rank, world_size
        self.worker = _worker_name(rank)
        self._prof: Any = None
        self.done = False
        self.trace: Path | None = None
        self.clock_ns: list[tuple[float, float]] = []
        """Per rank: (time.time_ns() right after the window's all-gather, host id)."""
        self.results: dict[str, Any] | None = None

    def covers(self, step: int) -> bool:
        """Steps the window slows down: its own, and the next (the trace is written in it)."""
        return self.first <= step <= self.last + 1

    def maybe_start(self, ledger: Any, next_step: int) -> None:
        if next_step == self.first and self._prof is None and not self.done:
            self._start(ledger)

    def after_step(self, ledger: Any, step: int) -> None:
        if self._prof is not None:
            if step >= self.last:
                self._stop(ledger, collective=True)
            else:
                self._prof.step()
        elif step == self.first - 1 and not self.done:
            self._start(ledger)

    def _start(self, ledger: Any) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        self.out.mkdir(parents=True, exist_ok=True)
        host_id = float(zlib.crc32(socket.gethostname().encode()) % 2**24)
        if ledger._gather is not None and self.world_size > 1:
            ledger.gather_raw([0.0, host_id])  # everyone leaves it at (nearly) one instant
        now = float(time.time_ns())
        if ledger._gather is not None and self.world_size > 1:
            rows = ledger.gather_raw([now, host_id])
            self.clock_ns = [(r[0], r[1]) for r in rows]
        activities = [ProfilerActivity.CPU]
        if ledger.device_type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            on_trace_ready=tensorboard_trace_handler(
                str(self.out), worker_name=self.worker, use_gzip=True
            ),
        )
        # Without a schedule torch.profiler adds no ProfilerStep#N spans (HTA and
        # TensorBoard split a trace into iterations by them): ask for them, numbered as
        # the training steps are.
        self._prof.record_steps = True
        self._prof.step_num = self.first
        with _without_kineto_chatter():
            self._prof.start()

    def _stop(self, ledger: Any, *, collective: bool) -> None:
        prof, self._prof = self._prof, None
        self.done = True
        with _without_kineto_chatter():
            prof.stop()  # calls the trace handler: the file is written now
        written = sorted(self.out.glob(f"{self.worker}.*.pt.trace.json.gz"))
        self.trace = written[-1] if written else None
        stats, kind = analyze_trace(self.trace) if self.trace else (None, "cpu")
        mine = {
            "rank": self.rank,
            "kind": kind,
            "trace": self.trace.name if self.trace else None,
            **(stats.as_dict() if stats else {}),
        }
        ledger.write({"kind": "profile", "first_step": self.first, "last_step": self.last, **mine})
        rows = [[float(self.rank), *(_vec(mine))]]
        if collective and ledger._gather is not None and self.world_size > 1:
            rows = ledger.gather_raw(_vec(mine, with_rank=self.rank))
        if self.rank == 0:
            self.results = {
                "first_step": self.first,
                "last_step": self.last,
                "definition": "HTA: overlap = |comm ∩ compute| / |comm|, exposed = |comm| - "
                "|comm ∩ compute| (CPU: Gloo's worker thread as the communication stream)",
                "kind": kind,
                "ranks": [_unvec(r) for r in rows],
            }
            (self.out / "overlap.json").write_text(
                json.dumps(self.results, indent=1) + "\n", encoding="utf-8"
            )

    def abandon(self, ledger: Any) -> None:
        """The run ended inside the window: write what was recorded (no collective)."""
        if self._prof is not None:
            self._stop(ledger, collective=False)

    def merge(self, ledger: Any) -> Path | None:
        """Rank 0, after the run: one trace with every rank's track, and one line that
        says where the traces are and the overlap they measured."""
        if not self.done:
            return None
        try:
            merged: Path | None = merge_traces(self.out, clock_ns=self.clock_ns)
        except (OSError, ValueError) as exc:
            ledger.say(f"scaletrain: could not merge the traces in {self.out}: {exc}")
            merged = None
        ledger.say(self.summary_line(merged))
        return merged

    def summary_line(self, merged: Path | None) -> str:
        """ "profile: steps 4-6 of 2 ranks traced to RUN/traces (...); communication
        overlapped with compute: median 41%, lowest 35% (rank 1)"."""
        ranks = (self.results or {}).get("ranks", [])
        where = f"profile: steps {self.first}-{self.last} of {len(ranks) or 1} rank"
        where += f"{'s' if len(ranks) != 1 else ''} traced to {self.out}"
        if merged is not None:
            where += f" ({merged.name}: every rank on one timeline, for Perfetto or TensorBoard)"
        measured = sorted(
            (float(r["overlap"]), int(r["rank"])) for r in ranks if r.get("overlap") is not None
        )
        if not measured:
            return f"{where}; no communication in the window, so no overlap to measure"
        median = statistics.median(m for m, _ in measured)
        low, rank = measured[0]
        overlap = f"median {median:.0%}, lowest {low:.0%} (rank {rank})"
        if len(measured) == 1:
            overlap = f"{low:.0%} (rank {rank})"
        return f"{where}; communication overlapped with compute in the traces: {overlap}"


_FIELDS = ("comm_s", "compute_s", "overlapped_s", "exposed_s")


def _vec(mine: dict[str, Any], with_rank: int | None = None) -> list[float]:
    values = [float("nan") if mine.get(k) is None else float(mine[k]) for k in _FIELDS]
    return values if with_rank is None else [float(with_rank), *values]


def _unvec(row: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": int(row[0])}
    for k, v in zip(_FIELDS, row[1:], strict=True):
        out[k] = None if v != v else v
    comm = out["comm_s"]
    out["overlap"] = out["overlapped_s"] / comm if comm else None
    return out


def newest_traces(directory: Path) -> dict[int, Path]:
    """The newest trace file of every rank in `directory`."""
    found: dict[int, Path] = {}
    for path in sorted(directory.glob("rank*.pt.trace.json.gz")):
        match = re.match(r"rank(\d+)_", path.name)
        if match:
            found[int(match.group(1))] = path  # sorted by name: later time_ns wins
    return found


def merge_traces(
    directory: str | Path, *, clock_ns: list[tuple[float, float]] | None = None
) -> Path:
    """Merge the newest trace of every rank into DIRECTORY/merged.json.gz."""
    directory = Path(directory)
    traces = newest_traces(directory)
    if not traces:
        raise ValueError(f"no rank*.pt.trace.json.gz in {directory}")
    loaded = {r: load_trace(p) for r, p in traces.items()}
    # Absolute wall-clock microseconds: ts + baseTimeNanoseconds (Kineto's layout).
    bases = {r: float(t.get("baseTimeNanoseconds", 0)) / 1e3 for r, t in loaded.items()}
    shift = {r: 0.0 for r in loaded}
    if clock_ns and len(clock_ns) == len(loaded):
        host0 = clock_ns[0][1]
        for r, (t_ns, host) in enumerate(clock_ns):
            if r in shift and host != host0:
                shift[r] = -(t_ns - clock_ns[0][0]) / 1e3  # another host's clock offset
    origin = min(
        (e["ts"] + bases[r] + shift[r])
        for r, t in loaded.items()
        for e in t.get("traceEvents", [])
        if e.get("ph") == "X" and "ts" in e
    )
    events: list[dict[str, Any]] = []
    for r, trace in sorted(loaded.items()):
        host = trace.get("host_name", "")
        events.append(
            {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r} ({host})"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}}
        )
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in (
                "process_name",
                "process_sort_index",
                "process_labels",
            ):
                continue
            e = dict(e)
            e["pid"] = r
            if "ts" in e and isinstance(e["ts"], (int, float)):
                e["ts"] = round(e["ts"] + bases[r] + shift[r] - origin, 3)
            if "id" in e and isinstance(e["id"], int):
                e["id"] = e["id"] + r * 10**9  # flow ids stay unique per rank
            events.append(e)
    out = directory / "merged.json.gz"
    with gzip.open(out, "wt", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out
