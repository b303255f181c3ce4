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
import math
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Collection, Iterable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError

__all__ = [
    "DEFAULT_HANG_TIMEOUT_S",
    "EXIT_HANG",
    "FLIGHT_RECORDER_DIR",
    "HANG_DIR",
    "HangDiagnosis",
    "HangReport",
    "Heartbeat",
    "Watchdog",
    "WatchdogConfig",
    "configure_flight_recorder",
    "dump_stacks",
    "find_laggards",
    "format_hang_message",
]

EXIT_HANG = 86
"""Exit status of every rank of a job the watchdog ended. Distinct from 1 (an
exception), 2 (a usage error) and the signal codes (128 + N), so a launcher or a
scheduler's retry policy can tell a hang from a crash."""

DEFAULT_HANG_TIMEOUT_S = 300.0
"""Seconds without a beat before a rank counts as hung (`--hang-timeout`): far above a
normal step, far below the process group's 30-minute collective timeout."""

HANG_DIR = "hang"
"""Sub-directory of the run directory for stacks, the report and the heartbeats."""

FLIGHT_RECORDER_DIR = "flight_recorder"
"""Sub-directory of the run directory for the collective traces, one file per rank
named rank_<r>: the layout `python -m torch.distributed.flight_recorder.fr_trace DIR`
reads."""

_STORE_PREFIX = "scaletrain/watchdog"  # PrefixStore adds the "/"
_LEADER_KEY = "leader"
_REQUEST_KEY = "request"
_REPORTED_KEY = "reported"
_STORE_TIMEOUT_S = 10.0
_MAX_DETAILED = 4  # laggards described one by one in the message; the rest are counted

# Frames under torch/ are library internals: "where" names the innermost frame outside,
# which is the user's line. A main thread whose innermost frame is in torch/distributed/
# is blocked inside a collective (Gloo runs them synchronously on the caller's thread).
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep


class _RankInfo(Protocol):
    """What the watchdog reads from a Runtime (duck-typed: observe imports no runtime)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


# ----------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """How long a rank may go without a beat, and how often the thread looks."""

    timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """Seconds without a beat after which this rank is hung (`--hang-timeout`)."""
    poll_s: float | None = None
    """Seconds between heartbeat publications and checks; None: timeout_s / 10,
    clamped to [0.05, 5]."""
    grace_s: float | None = None
    """Seconds the reporter waits for the other ranks to dump their stacks (a rank
    silent by then is dead or frozen), and as long again for their collective traces,
    before it reports and every rank exits; None: max(2, 3 x poll_s)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s)):
            raise ConfigError(
                f"hang timeout_s={self.timeout_s!r} is not a number; expected seconds, "
                "e.g. 300 (--hang-timeout 300)."
            )
        if self.timeout_s <= 0:
            raise ConfigError(
                f"hang timeout_s={self.timeout_s!r} must be positive: the seconds a rank "
                "may go without a beat, e.g. 300. To turn the watchdog off, do not create one."
            )
        if self.poll_s is None:
            self.poll_s = min(max(self.timeout_s / 10.0, 0.05), 5.0)
        if not (math.isfinite(self.poll_s) and 0 < self.poll_s <= self.timeout_s):
            raise ConfigError(
                f"poll_s={self.poll_s!r} must be in (0, timeout_s={self.timeout_s}]: the "
                "thread checks for a hang every poll_s seconds. Leave it unset for "
                "timeout_s / 10."
            )
        if self.grace_s is None:
            self.grace_s = max(2.0, 3.0 * self.poll_s)
        if not (math.isfinite(self.grace_s) and self.grace_s >= self.poll_s):
            raise ConfigError(
                f"grace_s={self.grace_s!r} must be >= poll_s={self.poll_s}: the other "
                "ranks look for the dump request every poll_s seconds, a shorter grace "
                "ends the job before they have written their stacks. Leave it unset for "
                "max(2, 3 x poll_s)."
            )


# ----------------------------------------------------------------------------------
# Heartbeats and the "who did not arrive" rules (pure functions)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One rank's progress as its watchdog thread last published it."""

    rank: int
    """Global rank."""
    step: int = -1
    """Step of the last beat; -1 before the first one."""
    phase: str = "start"
    """Phase of the last beat ("forward", "eval", ...)."""
    idle_s: float = 0.0
    """Seconds since the last beat, when this heartbeat was published."""
    seq: int | None = None
    """Collectives this rank had issued on the default process group (None: unknown)."""
    collective: str | None = None
    """The torch.distributed call the training thread is blocked in ("all_reduce"),
    "" when it is outside torch.distributed, None when unknown."""
    where: str = ""
    """The training thread's innermost frame outside torch: "train.py:42 in step"."""
    stopped: bool = False
    """True once the rank called Watchdog.stop(): it finished, it will not beat again."""
    host: str = ""
    """Host name of the rank's machine."""
    pid: int = 0
    """Process id of the rank."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


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


# ----------------------------------------------------------------------------------
# Dumps
# ----------------------------------------------------------------------------------


def _locate(frame: FrameType | None) -> tuple[str, str]:
    """(where, collective) of a thread's innermost frame; see _TORCH_DIR."""
    if frame is None:
        return "", ""
    collective = ""
    if os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIST_DIR):
        collective = frame.f_code.co_name
    f: FrameType | None = frame
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_TORCH_DIR):
        f = f.f_back
    target = f if f is not None else frame
    where = (
        f"{os.path.basename(target.f_code.co_filename)}:{target.f_lineno} "
        f"in {target.f_code.co_name}"
    )
    return where, collective


def dump_stacks(
    path: Path | str | None = None,
    *,
    header: str = "",
    watched: int | None = None,
) -> str:
    """Every Python thread's stack, readable (source lines included), as text.

    The `watched` thread (an ident; default: the main thread) comes first. With `path`
    the text is also written there (parents created). Used on a hang; safe to call
    any time from any thread.
    """
    if watched is None:
        watched = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != watched, names.get(ident, "~")))
    chunks = [header.rstrip("\n") + "\n\n" if header else ""]
    for ident in order:
        role = " -- the training thread (it calls beat())" if ident == watched else ""
        if ident == threading.get_ident():
            role = role or " -- this thread, writing the dump"
        chunks.append(
            f"Thread {names.get(ident, '<not started by threading>')!r} "
            f"(ident {ident}){role}, most recent call last:\n"
        )
        chunks.append("".join(traceback.format_stack(frames[ident])))
        chunks.append("\n")
    text = "".join(chunks)
    if path is not None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return text


def _flight_recorder_traces() -> list[tuple[str, bytes]]:
    """This process's non-empty flight recorder traces: ("nccl"|"cpu", pickle bytes).

    NCCL keeps its own recorder (dumped by _dump_nccl_trace, CUDA builds only); Gloo
    and other CPU backends record into the generic one (_dump_fr_trace, torch >= 2.8).
    Both take their own lock, so dumping from this thread while the main thread waits
    in a collective is what they are built for (NCCL's own watchdog does the same).
    """
    c10d: Any = torch._C._distributed_c10d
    found: list[tuple[str, bytes]] = []
    for kind, name in (("nccl", "_dump_nccl_trace"), ("cpu", "_dump_fr_trace")):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = bytes(fn())
            if pickle.loads(data).get("entries"):
                found.append((kind, data))
        except Exception:
            continue
    return found


def _sequence_number() -> int | None:
    """Collectives this process issued on the default group, or None.

    Reads a counter of the group from this thread, never calls into a collective.
    """
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group: Any = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except Exception:
        return None


# ----------------------------------------------------------------------------------
# Flight recorder
# ----------------------------------------------------------------------------------


def configure_flight_recorder(
    run_dir: Path | str,
    *,
    buffer_size: int = 2000,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Turn on PyTorch's collective flight recorder; call BEFORE the process group exists.

    Sets the variables torch reads when it creates a process group, where the user has
    not set them already (under either name): TORCH_FR_BUFFER_SIZE (entries kept per
    rank), TORCH_FR_DUMP_TEMP_FILE (where NCCL's own dump on a collective timeout goes:
    run_dir/flight_recorder/rank_<r>) and TORCH_NCCL_DUMP_ON_TIMEOUT=1. Torch before the
    vendor-neutral recorder (pytorch/pytorch#152563, 2.8) reads the older names
    TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE, which newer torch
    warns about: only the names this torch reads are set. The watchdog dumps the same
    recorder on a hang, on Gloo too where torch records Gloo collectives (>= 2.8).
    Returns what it set.
    """
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ConfigError(
            f"buffer_size={buffer_size!r} must be a positive integer (collectives kept "
            "per rank), e.g. 2000."
        )
    env = os.environ if environ is None else environ
    fr_dir = Path(run_dir) / FLIGHT_RECORDER_DIR
    # NCCL writes its own dump with a plain ofstream: the directory must exist first.
    fr_dir.mkdir(parents=True, exist_ok=True)
    new_names = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
    settings: list[tuple[tuple[str, str], str]] = [
        (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(buffer_size)),
        (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), f"{fr_dir}/rank_"),
        (("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"), "1"),
    ]
    done: dict[str, str] = {}
    for (new, old), value in settings:
        if new in env or old in env:
            continue  # the user's own choice, under either name, wins
        name = new if new_names else old
        env[name] = value
        done[name] = value
    if done and environ is None and dist.is_available() and dist.is_initialized():
        warnings.warn(
            "configure_flight_recorder() was called after the process group was created: "
            "the recorder's size is read when the group is created, so it may stay off. "
            "Call it before scaletrain.init().",
            stacklevel=2,
        )
    return done


# ----------------------------------------------------------------------------------
# The watchdog
# ----------------------------------------------------------------------------------


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

        wd = Watchdog(rt, timeout_s=300, run_dir="runs/x").start()
        for step, batch in enumerate(loader):
            wd.beat(step)                 # cheap: stores a tuple
            ...
        wd.stop()                         # or: with Watchdog(...) as wd:

    rt: anything with `.rank` and `.world_size` (a scaletrain Runtime); None reads
        RANK / WORLD_SIZE. `rank` / `world_size` override it.
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
        rt: _RankInfo | None = None,
        *,
        timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        run_dir: Path | str | None = None,
        poll_s: float | None = None,
        grace_s: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        store: dist.Store | None = None,
        exit_on_hang: bool = True,
    ) -> None:
        self.config = WatchdogConfig(timeout_s=timeout_s, poll_s=poll_s, grace_s=grace_s)
        assert self.config.poll_s is not None and self.config.grace_s is not None
        self._poll_s: float = self.config.poll_s  # resolved by WatchdogConfig
        self._grace_s: float = self.config.grace_s
        env_rank = int(os.environ.get("RANK", "0"))
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = rank if rank is not None else (rt.rank if rt is not None else env_rank)
        self.world_size = (
            world_size
            if world_size is not None
            else (rt.world_size if rt is not None else env_world)
        )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank={self.rank} is outside world_size={self.world_size}: expected "
                "0 <= rank < world_size. Pass the Runtime from scaletrain.init()."
            )
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
        self._prefix = f"{_STORE_PREFIX}/attempt{attempt}"

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
            thread.join(timeout=self._poll_s + _STORE_TIMEOUT_S)
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

    def _connect(self) -> dist.Store | None:
        if self._given_store is not None:
            return dist.PrefixStore(self._prefix, self._given_store)
        if self.world_size == 1:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        # A client of our own: a store object is not shared with the process group's
        # threads, and a hung collective cannot hold it.
        client = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            # Bounds connecting and every call; short enough that an unreachable store
            # cannot keep the thread from its local check for long.
            timeout=_dt.timedelta(
                seconds=min(_STORE_TIMEOUT_S, max(1.0, self.config.timeout_s / 2))
            ),
            wait_for_workers=False,
        )
        return dist.PrefixStore(self._prefix, client)

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
                    store = self._connect()
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
                    if store.check([_REQUEST_KEY]):
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

    def _dump_traces(self) -> list[Path]:
        files: list[Path] = []
        for i, (kind, data) in enumerate(_flight_recorder_traces()):
            self._trace_kinds.add(kind)
            # The first (NCCL's where there is one) gets the analyzer's default layout.
            folder = self.run_dir / FLIGHT_RECORDER_DIR
            if i > 0:
                folder = folder / kind
            target = folder / f"rank_{self.rank}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                files.append(target)
            except OSError as exc:
                print(f"scaletrain: cannot write {target}: {exc}", file=sys.stderr, flush=True)
        return files

    def _read_heartbeats(self, store: dist.Store) -> dict[int, Heartbeat]:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        found: dict[int, Heartbeat] = {}
        if store.check(keys):
            values = store.multi_get(keys)
            pairs = list(zip(range(self.world_size), values, strict=True))
        else:
            pairs = [(r, store.get(k)) for r, k in enumerate(keys) if store.check([k])]
        for r, value in pairs:
            with contextlib.suppress(ValueError, TypeError):
                found[r] = Heartbeat.from_json(value)
        return found

    def _gather(
        self, store: dist.Store, *, answer_by: float, traces_by: float
    ) -> tuple[dict[int, Heartbeat], set[int]]:
        """Wait for every rank's stacks (until `answer_by`: the ones that answered are
        alive) and their traces (until `traces_by`); return heartbeats and who answered."""
        every = range(self.world_size)
        pause = min(self._poll_s, 0.1)
        responsive = {self.rank}
        with contextlib.suppress(Exception):
            for prefix, deadline in (("ack", answer_by), ("done", traces_by)):
                while True:
                    wanted = [f"{prefix}/{r}" for r in every if r in responsive or prefix == "ack"]
                    if store.check(wanted):
                        if prefix == "ack":
                            responsive = set(every)
                        break
                    if prefix == "ack":
                        responsive |= {r for r in every if store.check([f"ack/{r}"])}
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(pause)
        heartbeats: dict[int, Heartbeat] = {}
        with contextlib.suppress(Exception):
            heartbeats = self._read_heartbeats(store)
        return heartbeats, responsive

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
                    got = store.compare_set(_LEADER_KEY, "", me)
                    leader = bytes(got).decode() == me
                    if leader:
                        store.set(_REQUEST_KEY, me)
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
        files += self._dump_traces()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"done/{self.rank}", "1")

        if not leader and store is not None:
            deadline = started + 2 * grace + 2 * poll
            reported = False
            while time.monotonic() < deadline:
                try:
                    if store.check([_REPORTED_KEY]):
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
            heartbeats, responsive = self._gather(
                store, answer_by=started + grace, traces_by=started + 2 * grace
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
                store.set(_REPORTED_KEY, me)
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
