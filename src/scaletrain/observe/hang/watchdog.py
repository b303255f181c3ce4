"""Hang watchdog: end a job whose ranks stopped making progress, naming who and where.

A rank that stops making progress (stuck in user code, a data loader, a file system,
or never reaching a collective its peers wait in) otherwise leaves every rank waiting
for the process group's timeout, 30 minutes by default, and then fails with an error
that names no one. The watchdog ends such a job within `timeout_s` plus a few seconds:

- `beat(step, phase)` is called from the training loop. It only stores a tuple
  (no lock, no I/O, no collective: well under a microsecond).
- A daemon thread per rank publishes this rank's heartbeat (step, phase, seconds
  since the last beat) to the job's key-value store, through a TCPStore client of its
  own connected to MASTER_ADDR:MASTER_PORT (under torchrun: the agent's store). It never
  uses a collective: the main thread may be stuck inside one, and a thread of ours
  entering the same process group would deadlock or corrupt it.
- When its rank has not beaten for `timeout_s`, the thread elects itself reporter
  (first to claim a store key) and asks every rank to dump. Every rank's thread (the
  stalled rank's too: its thread is alive while its main thread sleeps) writes its
  Python stacks to `run_dir/hang/rank{r}.txt` and, where the flight recorder is on
  (`configure_flight_recorder`), the collective trace to `run_dir/flight_recorder/`.
- The reporter names the rank(s) that did not arrive (`find_laggards`, rules in its
  docstring), prints one paragraph on stderr, writes it to `run_dir/hang/report.txt`,
  and every rank ends with `os._exit(EXIT_HANG)`: the main thread cannot be
  interrupted inside a Gloo/NCCL collective, so exiting is the only way out, and a
  worker failing makes torchrun end the whole job at once.

Without a store (world size 1, or MASTER_ADDR/MASTER_PORT unset) the watchdog still
works, locally: a stalled step is dumped, reported and ended the same way, with no
peers to name. Timing: a hang is seen within `timeout_s + poll_s` and the job ends at
most `2 x grace_s + poll_s` later (sooner when every rank answers).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from scaletrain.dist.topology import Topology
from scaletrain.errors import ConfigError
from scaletrain.observe.events import EvalEvent, LoopObserver, RunInfo, StepEvent
from scaletrain.observe.hang.diagnosis import HangDiagnosis, find_laggards
from scaletrain.observe.hang.flight_recorder import dump_traces
from scaletrain.observe.hang.heartbeat import (
    DEFAULT_HANG_TIMEOUT_S,
    EXIT_HANG,
    Heartbeat,
    WatchdogConfig,
)
from scaletrain.observe.hang.message import format_hang_message
from scaletrain.observe.hang.stacks import _locate, _sequence_number, dump_stacks
from scaletrain.observe.hang.store import (
    LEADER_KEY,
    REPORTED_KEY,
    REQUEST_KEY,
    STORE_PREFIX,
    STORE_TIMEOUT_S,
    connect_store,
    gather_answers,
)

__all__ = ["HANG_DIR", "HangReport", "Watchdog", "WatchdogObserver"]

HANG_DIR = "hang"
"""Sub-directory of the run directory for stacks, the report and the heartbeats."""


@dataclass(frozen=True, slots=True)
class HangReport:
    """What a watchdog found on a hang (kept in `Watchdog.report` when it does not exit)."""

    message: str
    """The paragraph printed on stderr."""
    diagnosis: HangDiagnosis
    """Who did not arrive."""
    heartbeats: dict[int, Heartbeat]
    """Every rank's last heartbeat, as read from the store (or this rank's alone)."""
    files: tuple[Path, ...] = field(default_factory=tuple)
    """Files this rank wrote: its stacks, its collective traces, the report."""
    reporter: bool = True
    """True on the rank that printed the message; False on the others."""


def _hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return ""


class Watchdog:
    """Ends a job whose ranks stopped making progress, naming who and where.

        wd = Watchdog(rt.topology, timeout_s=300, run_dir="runs/x").start()
        for step, batch in enumerate(loader):
            wd.beat(step)                 # cheap: stores a tuple
            ...
        wd.stop()                         # or: with Watchdog(...) as wd:

    topology: where this process sits (scaletrain.dist.Topology: `rt.topology` of the
        Runtime st.init returned), the one source of its rank and world size, as for a
        strategy; the environment's RANK / WORLD_SIZE are never read.
    timeout_s / poll_s / grace_s: see WatchdogConfig.
    run_dir: stacks go to run_dir/hang/, traces to run_dir/flight_recorder/; None: a
        scaletrain-hang-* directory in the temp dir (named in the message).
    store: a c10d Store for the heartbeats, used only from the watchdog's thread;
        default: a TCPStore client of its own to MASTER_ADDR:MASTER_PORT (world size > 1).
    exit_on_hang: True: every rank ends with os._exit(EXIT_HANG). False: the thread
        keeps the result in `.report` and ends, the process lives on (tests, notebooks).

    The clock starts at start(): set-up before the first beat (loading, compiling)
    counts, so start the watchdog after it or beat during it.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        run_dir: Path | str | None = None,
        poll_s: float | None = None,
        grace_s: float | None = None,
        store: dist.Store | None = None,
        exit_on_hang: bool = True,
    ) -> None:
        if not isinstance(topology, Topology):
            runtime = isinstance(getattr(topology, "topology", None), Topology)
            raise ConfigError(
                f"Watchdog({type(topology).__name__}): expected the job's Topology "
                "(scaletrain.dist.Topology), where the rank and world size come from. "
                + (
                    "Fix: pass rt.topology instead of the Runtime."
                    if runtime
                    else "Fix: pass rt.topology (rt = scaletrain.init(...)), or "
                    "Topology(rank=..., world_size=...) in a job without one."
                )
            )
        self.config = WatchdogConfig(timeout_s=timeout_s, poll_s=poll_s, grace_s=grace_s)
        assert self.config.poll_s is not None and self.config.grace_s is not None
        self._poll_s: float = self.config.poll_s  # resolved by WatchdogConfig
        self._grace_s: float = self.config.grace_s
        self.topology = topology
        self.rank = topology.rank
        self.world_size = topology.world_size
        if run_dir is None:
            job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
            run_dir = Path(tempfile.gettempdir()) / f"scaletrain-hang-{job or os.getpid()}"
        self.run_dir = Path(run_dir)
        self.hang_dir = self.run_dir / HANG_DIR
        self.exit_on_hang = exit_on_hang
        self.report: HangReport | None = None
        """The hang found, when exit_on_hang is False (None: no hang)."""
        self._given_store = store
        self._beat: tuple[int, str, float] = (-1, "start", time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: int | None = None
        self._store: dist.Store | None = None
        self._host = _hostname()
        self._trace_kinds: set[str] = set()
        # Keys of an elastic restart must not meet the previous attempt's leftovers in
        # the agent's store, which outlives the workers.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"{STORE_PREFIX}/attempt{attempt}"

    # -- the hot path -----------------------------------------------------------------
    def beat(self, step: int, phase: str = "step") -> None:
        """Record progress: this rank reached `phase` of `step`. Call from the loop.

        One tuple assignment (atomic under the GIL); the thread publishes it.
        """
        self._beat = (step, phase, time.monotonic())

    # -- life cycle ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while the watchdog's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Watchdog:
        """Start the thread; the thread calling start() is the one watched. Returns self."""
        if self.running:
            return self
        self._stop.clear()
        self._watched = threading.get_ident()
        self._beat = (self._beat[0], self._beat[1], time.monotonic())
        self._thread = threading.Thread(target=self._run, name="scaletrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, reason: str | None = None) -> None:
        """Stop watching and tell the others this rank left; safe to call twice.

        reason: replaces the phase in the last heartbeat (the context manager passes
        "left with <exception type>" when the block raised).
        """
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout=self._poll_s + STORE_TIMEOUT_S)
        self._thread = None
        store = self._store
        if store is not None and not thread.is_alive():
            # The thread has ended, so this thread may use its store now.
            if reason is not None:
                self._beat = (self._beat[0], reason, self._beat[2])
            with contextlib.suppress(Exception):
                store.set(f"hb/{self.rank}", self._heartbeat(full=False, stopped=True).to_json())
        self._store = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(reason=None if exc_type is None else f"left with {exc_type.__name__}")

    # -- the thread ------------------------------------------------------------------
    def _heartbeat(self, *, full: bool, stopped: bool = False) -> Heartbeat:
        step, phase, t = self._beat
        seq: int | None = None
        collective: str | None = None
        where = ""
        if full:
            seq = _sequence_number()
            frame = sys._current_frames().get(self._watched or -1)
            where, collective = _locate(frame)
        return Heartbeat(
            rank=self.rank,
            step=step,
            phase=phase,
            idle_s=round(time.monotonic() - t, 3),
            seq=seq,
            collective=collective,
            where=where,
            stopped=stopped,
            host=self._host,
            pid=os.getpid(),
        )

    def _run(self) -> None:
        cfg = self.config
        poll = self._poll_s
        store: dist.Store | None = None
        wants_store = self._given_store is not None or self.world_size > 1
        next_connect = 0.0
        warned = False
        published: tuple[int, str, float] | None = None
        while not self._stop.wait(poll):
            now = time.monotonic()
            if store is None and wants_store and now >= next_connect:
                try:
                    store = connect_store(
                        self._prefix,
                        self._given_store,
                        world_size=self.world_size,
                        timeout_s=cfg.timeout_s,
                    )
                    self._store = store
                    published = None
                except Exception as exc:
                    next_connect = now + max(5 * poll, 1.0)
                    if not warned:
                        warned = True
                        print(
                            f"scaletrain: watchdog on rank {self.rank} cannot reach the "
                            f"store at {os.environ.get('MASTER_ADDR')}:"
                            f"{os.environ.get('MASTER_PORT')} ({exc}); it watches this "
                            "rank alone until it can.",
                            file=sys.stderr,
                            flush=True,
                        )
                if store is None and not warned and self.world_size > 1:
                    warned = True
                    print(
                        f"scaletrain: watchdog on rank {self.rank}: MASTER_ADDR/MASTER_PORT "
                        "are not set, so it watches this rank alone (it cannot name peers).",
                        file=sys.stderr,
                        flush=True,
                    )
            beat = self._beat
            if store is not None:
                try:
                    if beat != published:
                        store.set(f"hb/{self.rank}", self._heartbeat(full=False).to_json())
                        published = beat
                    if store.check([REQUEST_KEY]):
                        self._on_hang(store, requested=True)
                        return
                except Exception:
                    # The store went away (its host rank exited): watch alone; the
                    # local check below still ends this rank if it is stuck.
                    store = None
                    self._store = None
                    next_connect = now + max(5 * poll, 1.0)
            if time.monotonic() - beat[2] >= cfg.timeout_s:
                self._on_hang(store, requested=False)
                return

    def _dump_own_stacks(self) -> list[Path]:
        step, phase, t = self._beat
        idle = time.monotonic() - t
        seq = _sequence_number()
        now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        header = (
            f"scaletrain hang watchdog: rank {self.rank} of {self.world_size}, host "
            f"{self._host}, pid {os.getpid()}, {now}\n"
            f"last beat: step {step}, phase {phase!r}, {idle:.1f} s ago "
            f"(timeout {self.config.timeout_s:g} s)\n"
            f"collectives issued on the default process group: "
            f"{'unknown' if seq is None else seq}\n"
        )
        path = self.hang_dir / f"rank{self.rank}.txt"
        try:
            dump_stacks(path, header=header, watched=self._watched)
        except OSError as exc:
            print(f"scaletrain: cannot write {path}: {exc}", file=sys.stderr, flush=True)
            return []
        return [path]

    def _on_hang(self, store: dist.Store | None, *, requested: bool) -> None:
        cfg = self.config
        poll, grace = self._poll_s, self._grace_s
        started = time.monotonic()
        me = str(self.rank)
        leader = store is None
        if store is not None:
            try:
                store.set(f"hb/{self.rank}", self._heartbeat(full=True).to_json())
                if not requested:
                    got = store.compare_set(LEADER_KEY, "", me)
                    leader = bytes(got).decode() == me
                    if leader:
                        store.set(REQUEST_KEY, me)
            except Exception:
                store, leader = None, True
        # Stacks first and answer at once (proves this rank alive); the collective trace
        # after: its first dump symbolizes the recorded Python frames (~2 s here).
        files = self._dump_own_stacks()
        if store is not None:
            try:
                # Published again: its idle time and location are current.
                store.set(f"hb/{self.rank}", self._heartbeat(full=True).to_json())
                store.set(f"ack/{self.rank}", json.dumps([str(f) for f in files]))
            except Exception:
                store, leader = None, True
        kinds, written = dump_traces(self.run_dir, self.rank)
        self._trace_kinds |= kinds
        files += written
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"done/{self.rank}", "1")

        if not leader and store is not None:
            deadline = started + 2 * grace + 2 * poll
            reported = False
            while time.monotonic() < deadline:
                try:
                    if store.check([REPORTED_KEY]):
                        reported = True
                        store.set(f"bye/{self.rank}", me)
                        break
                except Exception:
                    store = None  # the reporter's process hosted the store and is gone
                    break
                time.sleep(min(poll, 0.1))
            if reported:
                self._finish(None, files)
                return
            # The reporter vanished before reporting: report ourselves, as best we can.

        own = self._heartbeat(full=True)
        responsive: set[int] = {self.rank}
        if store is None:
            # Alone (world size 1, or the store is unreachable): no peers to name.
            heartbeats = {self.rank: own}
            diagnosis = HangDiagnosis(step=own.step, laggards=(), waiting=(self.rank,))
        else:
            heartbeats, responsive = gather_answers(
                store,
                rank=self.rank,
                world_size=self.world_size,
                pause=min(poll, 0.1),
                answer_by=started + grace,
                traces_by=started + 2 * grace,
            )
            heartbeats[self.rank] = self._heartbeat(full=True)
            diagnosis = find_laggards(heartbeats, self.world_size, responsive)
        traces = sorted({str(f.parent) + os.sep for f in files if f.name.startswith("rank_")})
        message = format_hang_message(
            diagnosis,
            heartbeats,
            timeout_s=cfg.timeout_s,
            hang_dir=self.hang_dir,
            traces=traces,
            nccl_trace="nccl" in self._trace_kinds,
            flight_recorder_hint=not traces and dist.is_available() and dist.is_initialized(),
        )
        report_path = self.hang_dir / "report.txt"
        try:
            self.hang_dir.mkdir(parents=True, exist_ok=True)
            report_path.write_text(message + "\n", encoding="utf-8")
            (self.hang_dir / "heartbeats.json").write_text(
                json.dumps({r: asdict(h) for r, h in sorted(heartbeats.items())}, indent=1),
                encoding="utf-8",
            )
            files.append(report_path)
        except OSError:
            pass
        print(message, file=sys.stderr, flush=True)
        report = HangReport(
            message=message,
            diagnosis=diagnosis,
            heartbeats=heartbeats,
            files=tuple(files),
            reporter=True,
        )
        if store is not None:
            # Where this process hosts the store (a job launched without torchrun), the
            # others must read "reported" before it goes: else each reports again.
            others = [f"bye/{r}" for r in sorted(responsive) if r != self.rank]
            deadline = time.monotonic() + 2 * poll + 0.5
            with contextlib.suppress(Exception):
                store.set(REPORTED_KEY, me)
                while others and not store.check(others) and time.monotonic() < deadline:
                    time.sleep(min(poll, 0.05))
        self._finish(report, files)

    def _finish(self, report: HangReport | None, files: list[Path]) -> None:
        if report is None:
            report = HangReport(
                message="",
                diagnosis=HangDiagnosis(step=self._beat[0], laggards=(), waiting=()),
                heartbeats={},
                files=tuple(files),
                reporter=False,
            )
        self.report = report
        if not self.exit_on_hang:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # The training thread may be inside a collective that no exception can reach:
        # only ending the process frees it, and torchrun then ends the other ranks.
        os._exit(EXIT_HANG)


class WatchdogObserver(LoopObserver):
    """The watchdog fed by the loop's events: every step and every evaluation batch is
    progress.

    The watchdog starts when training starts (set-up before it is not watched: loading
    data and building the model take as long as they take) and stops when the run ends.
    """

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_run_start(self, info: RunInfo) -> None:
        self.watchdog.beat(info.start_step)
        self.watchdog.start()

    def on_step_end(self, event: StepEvent) -> None:
        self.watchdog.beat(event.step)

    def on_eval_batch(self, step: int) -> None:
        self.watchdog.beat(step, "eval")

    def on_eval(self, event: EvalEvent) -> None:
        self.watchdog.beat(event.step, "step")

    def close(self) -> None:
        self.watchdog.stop()
