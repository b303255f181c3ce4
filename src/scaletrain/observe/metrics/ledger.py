"""The step ledger: where every rank's time goes, step by step, always on and cheap.

The ledger is a small state machine. Hooks on the model, the loader's iterator, the
optimizer and DDP's gradient buckets (scaletrain.observe.metrics.hooks, installed by rt.setup
and rt.loader) tell it when a phase starts; the time between two switches belongs to
the phase that was running, so the phases of a step add up to its wall time (the time
from the previous optimizer step's end to this one's). A switch costs one clock read
(or one CUDA event record) and a few list operations; nothing synchronises a GPU, and
the only collective is one small all-gather every K steps (and at steps 10 and 20, so a
straggler is named early).

Which phase the time belongs to, and how each hook switches it (bracketed phases,
modes, compiling over them all), is the state machine's part, in
scaletrain.observe.metrics.switching; this module holds the rest: the steps, the
windows, the records and the end.

A step that compiled is flagged "compile" and, like the warm-up step, left out of the
statistics: window medians (so of the straggler scores), the run's means, the step time
and MFU of the summary. Its whole step is left out, not only its compile seconds: the rest
of it is no typical step either (new kernels' first runs, CUDA graphs recorded, the
autotuner's trials). Its seconds per phase stay in its record on disk; its compile
seconds are summed apart (`CompileTally`), for the summary's compile line.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scaletrain.observe.metrics.clocks import CudaTimeline, StepTimes, Timeline, WallTimeline
from scaletrain.observe.metrics.phases import (
    COMPILE,
    EVAL,
    OTHER,
    PHASES,
    SYNC,
)
from scaletrain.observe.metrics.records import (
    FORMAT_VERSION,
    RankLog,
    append_window,
    clean_json,
    rank_file,
)
from scaletrain.observe.metrics.runqueue import RunQueueClock
from scaletrain.observe.metrics.series import CompileTally, Reduced, Series, Totals, union_length
from scaletrain.observe.metrics.stragglers import Straggler, StragglerDetector, StragglerOptions
from scaletrain.observe.metrics.switching import PhaseMachine
from scaletrain.observe.metrics.window import RankWindow, WindowStats, pack, summarize, unpack

__all__ = ["EARLY_WINDOWS", "Gather", "LedgerConfig", "StepLedger", "in_phase"]

Gather = Callable[[list[float]], list[list[float]]]
"""Every rank's vector, by rank, from this rank's: one all-gather (a collective)."""

EARLY_WINDOWS = (10, 20)
"""Steps (of this process) at which a window closes early, before every K-th step."""


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """How the step ledger runs: `st.init(ledger=st.LedgerConfig(...))`; `ledger=False` turns
    it off (as does the environment variable SCALETRAIN_LEDGER=0)."""

    out: str | Path | None = None
    """Run directory: records go to OUT/observe/rank<r>.jsonl. None: $SCALETRAIN_RUN_DIR,
    else no files (the summary and straggler warnings are still printed)."""
    every: int = 50
    """Steps per window: one small all-gather every `every` steps."""
    flops: bool = True
    """Count FLOPs once and measure the device's peak for MFU."""
    summary: bool | Literal["line", "table"] = "line"
    """What rank 0 prints at the end: "line", one line (step time, MFU, the straggler if
    any, where the files are); "table", the phase table with overlap, MFU, memory and
    advice (what `scaletrain train` prints); False, nothing (True: the table)."""
    stragglers: StragglerOptions = field(default_factory=StragglerOptions)


@contextlib.contextmanager
def in_phase(ledger: StepLedger | None, phase: int, *, mode: bool = False) -> Iterator[None]:
    """Count the block as `phase` in `ledger` (if any); a mode (eval, checkpoint) absorbs
    everything inside it."""
    if ledger is None:
        yield
        return
    (ledger.begin_mode if mode else ledger.push)(phase)
    try:
        yield
    finally:
        (ledger.end_mode if mode else ledger.pop)(phase)


class StepLedger(PhaseMachine):
    """One rank's ledger. Made by `st.init` (as `rt.ledger`); hooks drive it."""

    def __init__(
        self,
        config: LedgerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: Any = "cpu",
        backend: str = "gloo",
        peer_group: int = 0,
        precision: str = "32",
        local_world_size: int = 1,
        gather: Gather | None = None,
        timeline: Timeline | None = None,
        printer: Callable[[Any], None] | None = None,
        device_name: str | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.device_type = getattr(device, "type", str(device))
        self.backend, self.peer_group, self.precision = backend, peer_group, precision
        self.local_world_size = local_world_size
        self.host = socket.gethostname()
        self._gather = gather
        self.printer = printer
        if timeline is None:
            timeline = (
                CudaTimeline(len(PHASES))
                if self.device_type == "cuda"
                else WallTimeline(len(PHASES))
            )
        self._timeline = timeline
        self.detector = StragglerDetector(config.stragglers)
        self.listeners: list[Callable[[WindowStats, list[Straggler]], None]] = []
        self.windows: list[WindowStats] = []
        self.start_step = 0
        self.closed = 0
        """Steps closed by this process."""
        self._cur = OTHER
        self._base = OTHER
        self._stack: list[int] = []
        self._modes: list[int] = []
        self._sticky_eval = False
        self._loading_steps = 0
        """Optimizer steps begun inside a checkpoint's load, not yet ended."""
        self._compiling = 0
        """Compilations under way (dynamo's callbacks; nested ones counted once)."""
        self.compile_watched = False
        """Dynamo's compile callbacks reach this ledger (scaletrain.observe.metrics.hooks)."""
        self._compiled_window = CompileTally()
        self.compiled = CompileTally()
        """torch.compile's seconds over the run's steps that compiled."""
        self._active = False
        self._finished = False
        self._buckets: list[tuple[float, float]] = []
        self._spans: list[tuple[float, float]] = []
        self._bwd_start = 0.0
        self._flags: list[str] = []
        self._cpu_last = time.process_time()
        self._window = Series()
        self._window_first = 1
        self.run = Totals()
        self._unix_offset = time.time() - time.perf_counter()
        self._log: RankLog | None = None
        self.out: Path | None = None
        self.flops: Any = None
        """A FlopCounter while FLOPs are to be counted; None when off."""
        self.flops_per_step: float | None = None
        self.peak_measured: float | None = None
        self.peak_datasheet: float | None = None
        self.peak_dtype = "fp32"
        self.device_name = device_name or self.device_type
        self.memory: Any = None
        self.runqueue: RunQueueClock | None = None
        """The training thread's wait for a CPU, read once per window (made at the first
        hook, on the thread that runs the loop)."""
        self._runqueue_closed = 0
        self.rss_setup: int | None = None
        """RSS (bytes) when rt.setup attached the ledger and restarted the peak RSS;
        None where the peak could not be restarted (not Linux)."""
        self.profile: Any = None
        """A ProfileWindow (scaletrain.observe.metrics.profiling) armed by rt.profile()."""
        self.summary: dict[str, Any] | None = None
        if config.out is not None:
            self.set_out(config.out)

    # -- set-up ---------------------------------------------------------------------
    def set_out(self, out: str | Path) -> None:
        """Write this rank's records to OUT/observe/rank<r>.jsonl (appending on resume)."""
        if self._log is not None:
            self._log.close()
        self.out = Path(out)
        self._log = RankLog(rank_file(self.out, self.rank))
        names = ("rank", "world_size", "host", "backend", "peer_group", "precision")
        header: dict[str, Any] = {"kind": "run", "v": FORMAT_VERSION}
        header.update({k: getattr(self, k) for k in names})
        header.update(
            pid=os.getpid(),
            clock=self._timeline.kind,
            device=self.device_type,
            device_name=self.device_name,
            every=self.config.every,
            phases=list(PHASES),
            unix=round(time.time(), 6),
            start_step=self.start_step,
        )
        self._log.write(header)
        self._log.flush()

    def set_start_step(self, step: int) -> None:
        """Steps already done before this process started (a resumed run)."""
        self.start_step = step

    @property
    def step(self) -> int:
        """Optimizer steps done (resumed ones included)."""
        return self.start_step + self.closed

    def _activate(self) -> None:
        # Time before the first hook (building the model, loading data) is no step's.
        self._active = True
        self._timeline.restart()
        if self.runqueue is None:
            self.runqueue = RunQueueClock()
        self._runqueue_closed = self.closed
        self._cpu_last = time.process_time()
        if self.profile is not None:
            self.profile.maybe_start(self, self.step + 1)

    # -- steps and windows ------------------------------------------------------------
    def _close_step(self) -> None:
        if self._finished or not self._active:
            return
        self.closed += 1
        step = self.step
        flags = self._flags
        if self.closed == 1:
            flags.append("warmup")
        if self.profile is not None and self.profile.covers(step):
            flags.append("profiled")
        busy = overlap = None
        if self._timeline.kind == "wall" and self._buckets:
            buckets = self._buckets
            lo = min(a for a, _ in buckets)
            hi = max(b for _, b in buckets)
            busy = union_length(buckets, lo, hi)
            hidden = sum(union_length(buckets, a, b) for a, b in self._spans)
            overlap = min(hidden / busy, 1.0) if busy > 0 else None
        cpu_now = time.process_time()
        tag = (step, tuple(flags), cpu_now - self._cpu_last, busy, overlap)
        self._cpu_last = cpu_now
        self._timeline.close(self._cur, tag)
        self._buckets, self._spans, self._flags = [], [], []
        for times in self._timeline.ready():
            self._record(times)
        if self.closed in EARLY_WINDOWS or self.closed % self.config.every == 0:
            # The ledger's own work (the gather, writing the window) counts as sync.
            self.push(SYNC)
            try:
                self._close_window()
            finally:
                self.pop(SYNC)
        if self.profile is not None:
            self.profile.after_step(self, step)

    def _record(self, times: StepTimes) -> None:
        step, flags, cpu, busy, overlap = times.tag
        if self._log is not None:
            unix_end = time.time()
            self._log.step(
                step,
                unix_end,
                times.wall,
                times.seconds,
                cpu=cpu,
                comm_busy=busy,
                overlap=overlap,
                flags=flags,
            )
        if "compile" in flags:
            self._compiled_window.add(step, times.seconds[COMPILE])
            self.compiled.add(step, times.seconds[COMPILE])
        if not flags:
            self._window.add(times, cpu, busy, overlap)
            self.run.add(times, cpu, busy, overlap)

    def _rank_window(
        self, reduced: Reduced, cpu_wait: float | None, compiled: CompileTally
    ) -> RankWindow:
        sample = self.memory.sample() if self.memory is not None else None
        return summarize(
            reduced,
            rank=self.rank,
            peer_group=self.peer_group,
            sample=sample,
            flops=self.flops_per_step,
            host=self.host,
            cpu_wait=cpu_wait,
            compiled=compiled,
        )

    def _window_cpu_wait(self) -> float | None:
        """Seconds per step the training thread waited for a CPU since the last window."""
        steps = self.closed - self._runqueue_closed
        self._runqueue_closed = self.closed
        waited = self.runqueue.lap() if self.runqueue is not None else None
        return waited / steps if waited is not None and steps > 0 else None

    def _run_cpu_wait(self) -> float | None:
        """Seconds per step the training thread waited for a CPU over the whole run."""
        waited = self.runqueue.total() if self.runqueue is not None else None
        return waited / self.closed if waited is not None and self.closed > 0 else None

    def gather_raw(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (one all-gather, counted as sync; a collective)."""
        if self._gather is None or self.world_size == 1:
            return [values]
        self.push(SYNC)
        try:
            return self._gather(values)
        finally:
            self.pop(SYNC)

    def gather(self, mine: RankWindow) -> list[RankWindow]:
        """Every rank's window."""
        return unpack(self.gather_raw(pack(mine)))

    def _close_window(self) -> None:
        mine = self._rank_window(
            self._window.reduce(), self._window_cpu_wait(), self._compiled_window
        )
        if self._log is not None:
            keys = ("allocated_peak", "reserved_peak", "rss_peak", "gpu_util")
            memory = {k: getattr(mine, k) for k in keys}
            memory["rss_setup"] = self.rss_setup
            self._log.write(clean_json({"kind": "memory", "step": self.step, **memory}))
        stats = WindowStats.build(self._window_first, self.step, self.gather(mine))
        self._window = Series()
        self._compiled_window = CompileTally()
        self._window_first = self.step + 1
        self.windows.append(stats)
        newly = self.detector.update(stats)
        if self.rank == 0:
            self._write_window(stats)
            for straggler in newly:
                self.say("scaletrain: " + straggler.describe(self.host_of(straggler.rank)))
        for listener in self.listeners:
            listener(stats, newly)
        if self._log is not None:
            self._log.flush()

    def _write_window(self, stats: WindowStats) -> None:
        if self.out is not None:
            append_window(self.out, stats, list(self.detector.candidates.values()))

    def _write_flops(self) -> None:
        if self._log is not None:
            self._log.write(
                {
                    "kind": "flops",
                    "step": self.step + 1,
                    "flops_per_step": self.flops_per_step,
                    "dtype": self.peak_dtype,
                    "peak_measured": self.peak_measured,
                    "peak_datasheet": self.peak_datasheet,
                    "device_name": self.device_name,
                }
            )

    def host_of(self, rank: int) -> str | None:
        return self.host if rank == self.rank else None

    def say(self, message: Any) -> None:
        """A line (or a rich renderable) for the person watching, on rank 0."""
        if self.rank != 0:
            return
        if self.printer is not None:
            self.printer(message)
        else:
            from rich.console import Console

            Console(file=sys.stderr, soft_wrap=True).print(message, highlight=False)

    def write(self, record: dict[str, Any]) -> None:
        """Another line in this rank's file (a profile window's results)."""
        if self._log is not None:
            self._log.write(record)
            self._log.flush()

    # -- the end ----------------------------------------------------------------------
    def finish(self, *, collective: bool = True) -> dict[str, Any] | None:
        """Read the last steps, gather every rank's whole-run medians (a collective when
        `collective`), write summary.json and print the table (rank 0). Once."""
        if self._finished:
            return self.summary
        for times in self._timeline.flush():
            self._record(times)
        if self._sticky_eval:
            self.end_mode(EVAL)
        self._finished = True
        if self.profile is not None:
            self.profile.abandon(self)
        if not collective or self.closed == 0:
            self.close()
            return None
        from scaletrain.observe.metrics.summary import build_summary, print_line, print_summary

        ranks = self.gather(
            self._rank_window(self.run.reduce(), self._run_cpu_wait(), self.compiled)
        )
        stats = WindowStats.build(self.start_step + 1, self.step, ranks)
        self.summary = build_summary(self, stats)
        if self.rank == 0:
            if self.out is not None:
                import json

                path = self.out / "observe" / "summary.json"
                path.write_text(
                    json.dumps(clean_json(self.summary), indent=1) + "\n",
                    encoding="utf-8",
                )
            if self.config.summary in (True, "table"):
                print_summary(self.summary, self.say)
            elif self.config.summary == "line":
                print_line(self.summary, self.say, self.out)
        if self.profile is not None and self.rank == 0:
            self.profile.merge(self)
        self.close()
        return self.summary

    def close(self) -> None:
        self._finished = True
        if self.flops is not None and self.flops.active:
            # A run that ended before its first optimizer step: the count's dispatch mode
            # (and torch.compile's eager stance) must not outlive it, or every later
            # forward in the process runs under them.
            self.flops.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
