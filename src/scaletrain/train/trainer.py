"""The Trainer behind `scaletrain train`: set up, resume, loop, report.

It uses only what a user's own script would (st.init, rt.setup, rt.loader,
rt.reduce, rt.save/rt.load) plus the loop's two plain functions (`train_step`,
`evaluate`), and tells what happens to LoopObservers (scaletrain.observe.events): the
progress bar, metrics.jsonl, the hang watchdog, the step ledger and the trackers are
observers, and so is anything a caller passes in.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from scaletrain.dist import from_rank_zero
from scaletrain.errors import spell
from scaletrain.exitcodes import EXIT_PREEMPTED
from scaletrain.observe.events import EventBus, LoopObserver
from scaletrain.runtime import LedgerConfig, Runtime, init
from scaletrain.runtime.signals import StopRequest
from scaletrain.train.config import TrainConfig
from scaletrain.train.observers import MetricsLog, ProgressPrinter
from scaletrain.train.recipes import Recipe, recipe_for
from scaletrain.train.rundir import (
    PIDS_DIR,
    clear_run,
    inspect_run,
    refuse_reuse,
    set_aside_interrupted,
)
from scaletrain.train.session import PREEMPTED_MARKER, Preempted, Session

__all__ = ["EXIT_PREEMPTED", "PREEMPTED_MARKER", "Preempted", "Trainer"]


class Trainer:
    """Trains a recipe with a strategy; `run()` returns the final summary.

    With an `out` directory that holds checkpoints, it resumes from the newest valid
    one: weights, optimizer, loader position (mid-epoch too), every rank's RNG and the
    step counter, so a resumed run ends bitwise equal to an uninterrupted one.
    `observers` (LoopObservers) are told about the run, every step, evaluation, save
    and stop.
    """

    def __init__(
        self, config: TrainConfig, observers: Iterable[LoopObserver] = (), *, worker: bool = False
    ) -> None:
        self.config = config
        self.worker = worker
        """One process of a launched job: a Ctrl-C before its process group forms ends it
        at once and quietly (see scaletrain.runtime.signals); its launcher says it."""
        self.recipe: Recipe = recipe_for(config)
        self.extra_observers = list(observers)
        self.first_failure = True
        """After run() raised: whether this rank was the first of the job to fail (the one
        that should report it; the others failed because of it)."""

    def run(self) -> dict[str, Any]:
        cfg = self.config
        run_dir = cfg.fork or cfg.out
        if cfg.hang_timeout > 0 and run_dir and torch.cuda.is_available():
            from scaletrain.observe import configure_flight_recorder

            # Before the process group exists: NCCL reads these when it is created.
            configure_flight_recorder(run_dir)
        self._out: Path | None = None
        self._created = False
        stop = StopRequest(on_abort=self._tidy_out).install(exit_until_armed=self.worker)
        rt: Runtime | None = None
        failed = False
        try:
            rt = init(
                strategy=cfg.strategy_object(),
                backend=cfg.backend,
                mesh=cfg.mesh,
                precision=cfg.precision,
                ledger=(
                    LedgerConfig(every=cfg.ledger_every, summary="table") if cfg.ledger else False
                ),
            )
            stop.arm()
            out, notes = self._prepare_out(rt)
            with contextlib.closing(self._observers(rt, out)) as observers:
                session = Session(self.config, self.recipe, rt, stop, out, observers, notes)
                return session.run()
        except Exception:
            failed = True
            from scaletrain.dist import claim_first

            # Before shutdown: the claim goes through the process group's store.
            self.first_failure = claim_first("failure")
            raise
        except BaseException:
            failed = True
            raise
        finally:
            stop.restore()
            if rt is not None:
                # After a failure the ledger's summary (a collective) is skipped.
                rt.shutdown(failed=failed)
            self._tidy_out()

    # -- set-up ---------------------------------------------------------------------
    def _prepare_out(self, rt: Runtime) -> tuple[Path, list[str]]:
        """The run directory, checked and made; the header's notes about what it held."""
        cfg, recipe = self.config, self.recipe
        named = cfg.fork or cfg.out
        if named:
            out = Path(named)
        else:
            # No job id to name the run after (see scaletrain.launch.training): rank 0's
            # clock names it for every rank, on every node.
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path(from_rank_zero(str(Path("runs") / f"{recipe.name}-{stamp}")))
            self.config = cfg = cfg.replace(out=str(out))
        found = inspect_run(out)
        # --overwrite replaces the run the command found, once: workers restarted by the
        # elastic agent (--max-restarts) resume from what this job saved since.
        overwrite = cfg.overwrite and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        refuse_reuse(found, overwrite=overwrite, field="fork" if cfg.fork else "out")
        rt.barrier()  # every rank has looked before rank 0 changes anything
        notes: list[str] = []
        if rt.is_main:
            self._created = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            if overwrite and found.holds_run:
                removed = ", ".join(clear_run(out))
                notes.append(f"replaced the run in {out} ({spell('overwrite', True)}: {removed})")
            else:
                aside = set_aside_interrupted(found)
                notes += [aside] if aside else []
            (out / PREEMPTED_MARKER).unlink(missing_ok=True)
        rt.barrier()
        # Where each worker runs, for operators (and the fault-tolerance test) to find it;
        # removed at exit. parents=True: on another node's own disk, rank 0's mkdir
        # above did not happen.
        self._out, self._rank = out, rt.rank
        pids = out / PIDS_DIR
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"rank{rt.rank}.pid").write_text(f"{os.getpid()}\n")
        return out, notes

    def _tidy_out(self) -> None:
        """At exit: this rank's pid file goes (pids/ with the last one), and a run
        directory this start made and left empty (it failed before writing) too."""
        if self._out is None:
            return
        pids = self._out / PIDS_DIR
        (pids / f"rank{self._rank}.pid").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            pids.rmdir()  # the last rank out removes it
        if self._created:
            metrics = self._out / "metrics.jsonl"
            with contextlib.suppress(OSError):
                if metrics.stat().st_size == 0:
                    metrics.unlink()  # nothing was trained
            with contextlib.suppress(OSError):
                self._out.rmdir()  # only if empty

    def _observers(self, rt: Runtime, out: Path) -> EventBus:
        """Who hears about the run: rank 0's progress bar and metrics.jsonl, the step
        ledger, the trackers, the hang watchdog, then the caller's own observers."""
        cfg = self.config
        observers = EventBus()
        printer: ProgressPrinter | None = None
        if rt.is_main:
            printer = ProgressPrinter()
            observers.add(printer)
            observers.add(MetricsLog(out / "metrics.jsonl"))
        if rt.ledger is not None:
            from scaletrain.observe.metrics.ledger_observer import LedgerObserver

            if printer is not None:
                # Straggler warnings and the end-of-run table above the live progress bar.
                rt.ledger.printer = printer.print
            observers.add(LedgerObserver(rt.ledger, profile=cfg.profile))
        if rt.is_main:
            from scaletrain.observe.report.trackers import TrackerObserver, make_trackers

            # --track: rank 0 alone writes (its loss and evaluation are already reduced
            # over the ranks; the ledger's windows are gathered from every rank).
            for tracker in make_trackers(cfg.track):
                observers.add(TrackerObserver(tracker, rt.ledger))
        if cfg.hang_timeout > 0 and rt.world_size > 1:
            from scaletrain.observe.hang.watchdog import Watchdog, WatchdogObserver

            watchdog = Watchdog(rt.topology, timeout_s=cfg.hang_timeout, run_dir=out)
            observers.add(WatchdogObserver(watchdog))
        for extra in self.extra_observers:
            observers.add(extra)
        return observers
