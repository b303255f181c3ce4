"""One `scaletrain train` run inside one process: set up, resume, the epochs, the end.

`Session.run()` is the loop with its seams: `train_step` and `evaluate` do the work
(scaletrain.train.loop), observers hear about it (scaletrain.observe.events), and the
header and summary they are told are scaletrain.train.announce's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint import CheckpointManager, Resumed
from scaletrain.checkpoint.full import save_file
from scaletrain.errors import ConfigError, spell
from scaletrain.observe.events import EvalEvent, EventBus, StepEvent
from scaletrain.runtime import Runtime, sync_batchnorm
from scaletrain.runtime.signals import StopRequest
from scaletrain.runtime.stopping import StopAgreement
from scaletrain.train.announce import fork_parent, plural, run_info, run_summary
from scaletrain.train.config import TrainConfig
from scaletrain.train.length import RunLength
from scaletrain.train.loop import TimedBatches, evaluate, seed_everything, train_step
from scaletrain.train.positions import check_batch_length, position_table
from scaletrain.train.recipes import Recipe
from scaletrain.train.resolved import resolved_config
from scaletrain.train.resume import (
    check_meaning,
    fork_from,
    has_checkpoints,
    read_json,
    refuse_length,
)
from scaletrain.train.rundir import PREEMPTED_MARKER
from scaletrain.train.schedule import lr_at, set_lr

__all__ = ["PREEMPTED_MARKER", "Preempted", "Session"]


class Preempted(Exception):
    """The run saved and stopped on a signal; exit with EXIT_PREEMPTED."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted at step {step}; checkpoint saved")
        self.step = step


@contextlib.contextmanager
def _saves_finished(manager: CheckpointManager) -> Iterator[None]:
    """Around the run: the saves in flight finish (or fail) before the process group
    goes. When the run itself failed, that error is the one to report, not the close's."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            manager.close()
        raise
    manager.close()


@dataclass(slots=True)
class _Progress:
    """What the loop has done so far (restored from a checkpoint on resume)."""

    step: int = 0
    train_time: float = 0.0
    compile_before: float = 0.0
    """torch.compile's seconds inside train_time before this start (a resumed run's)."""
    samples: int = 0
    time_before: float = 0.0
    samples_before: int = 0
    """train_time and samples before this start (a resumed run's): this start's share is
    what it added."""
    stopped_by: str | None = None
    last_eval: EvalEvent | None = None
    saved: Path | None = None
    resumed: Resumed | None = None
    forked: Path | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """The plain values of the checkpoint resumed from (its step, length, config)."""


class Session:
    """One run in this process: everything set up once, then the epochs, then the end."""

    def __init__(
        self,
        config: TrainConfig,
        recipe: Recipe,
        rt: Runtime,
        stop: StopRequest,
        out: Path,
        observers: EventBus,
        notes: list[str] | None = None,
    ) -> None:
        self.cfg = cfg = config
        self.recipe = recipe
        self.rt, self.stop, self.out, self.observers = rt, stop, out, observers
        self.batch_size = cfg.batch_size or recipe.batch_size
        self.eval_batch_size = cfg.eval_batch_size or recipe.eval_batch_size
        self.sync_bn = recipe.sync_bn if cfg.sync_bn is None else cfg.sync_bn
        self.warmup = recipe.warmup if cfg.warmup is None else cfg.warmup
        self.done = _Progress()
        self.agreement = StopAgreement(rt, stop, cfg.stop_after)
        self.notes = list(notes or [])
        """Header lines about what the run directory held (set aside, overwritten)."""

    # -- set-up ---------------------------------------------------------------------
    def _build(self) -> None:
        cfg, recipe, rt = self.cfg, self.recipe, self.rt
        seed_everything(cfg.seed)
        self.data_path = recipe.locate_data(cfg.data_dir)
        # One rank per node reads (and would download/prepare) first; the others then
        # read the files it checked. A bad file fails on every rank with its message.
        with rt.rank_zero_first():
            self.train_set = recipe.data(cfg.data_dir, "train")
            self.test_set = recipe.data(cfg.data_dir, "test")
        model = recipe.build()
        named = spell("model", recipe.spec) if recipe.spec else spell("recipe", recipe.name)
        # Each epoch's first batch, against the model's position table.
        self.check_batch = functools.partial(check_batch_length, position_table(model), owner=named)
        if self.sync_bn:
            model = sync_batchnorm(model)
        self.global_batch = self.batch_size * rt.dp_size * cfg.accumulate
        self.lr = cfg.lr if cfg.lr is not None else recipe.scaled_lr(self.global_batch)
        optimizer = recipe.optimizer(model.parameters(), self.lr)
        self.model, self.optimizer = rt.setup(model, optimizer)
        self.loader = rt.loader(
            self.train_set,
            self.batch_size,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
            num_workers=cfg.num_workers,
        )
        self.eval_loader = rt.loader(
            self.test_set,
            self.eval_batch_size,
            shuffle=False,
            pad=False,
            num_workers=cfg.num_workers,
        )
        self.steps_per_epoch = len(self.loader) // cfg.accumulate
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"an epoch of {len(self.loader)} batch(es) per replica is shorter than "
                f"{spell('accumulate', cfg.accumulate)}: no optimizer step would ever run. "
                f"Fix: lower {spell('accumulate')} or {spell('batch_size')}.",
                field="accumulate",
            )
        self.epochs_wanted = cfg.epochs or recipe.epochs
        self.state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "loader": self.loader,
        }
        self.manager = CheckpointManager(
            rt, self.out, every=cfg.save_every, keep=cfg.keep, async_save=cfg.async_save
        )

    def _plan(self) -> None:
        """The run's length from the config (and, after a resume, where its epoch stands)."""
        cfg, resumed = self.cfg, self.done.resumed
        at_checkpoint = resumed is not None and resumed.path is not None and not cfg.fork
        self.length = RunLength.plan(
            steps_per_epoch=self.steps_per_epoch,
            epochs=self.epochs_wanted,
            max_steps=cfg.max_steps,
            step=self.done.step,
            loader_epoch=self.loader.epoch,
            steps_left_in_epoch=self.loader.remaining() // cfg.accumulate
            if at_checkpoint
            else None,
        )
        self.total_steps, self.epochs = self.length.total_steps, self.length.epochs
        if cfg.max_steps is not None and self.total_steps < cfg.max_steps:
            # The epochs end the run first: said, since a step count asked for reads as
            # the run's length (a model module's default is one epoch).
            more = -(-(cfg.max_steps - self.total_steps) // self.steps_per_epoch)
            self.notes.append(
                f"{spell('max_steps', cfg.max_steps)} is past the end of "
                f"{plural(self.epochs_wanted, 'epoch')} ({self.total_steps} steps): the run "
                f"stops at step {self.total_steps}. For {cfg.max_steps}, add "
                f"{spell('epochs', self.epochs_wanted + more)}."
            )

    def _resolved(self) -> dict[str, Any]:
        rt, recipe = self.rt, self.recipe
        return resolved_config(
            self.cfg,
            rt,
            recipe=recipe.name if recipe.spec is None else None,
            nproc=rt.env.local_world_size,
            backend=rt.backend,
            epochs=self.epochs_wanted,
            batch_size=self.batch_size,
            eval_batch_size=self.eval_batch_size,
            lr=self.lr,
            warmup=self.warmup,
            sync_bn=self.sync_bn,
            data_dir=self.data_path,
            out=str(self.out),
            # config.json describes this run: replayed, it trains it (a fork's source is
            # in its checkpoints' history, not a setting to fork again).
            fork=None,
            fork_optimizer=False,
            overwrite=False,
        )

    def _prepare_model(self) -> None:
        # Pipeline stages are traced from a batch; build them before loading into them.
        example = next(
            iter(torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size))
        )
        self.rt.prepare(self.model, example[0].to(self.rt.device))

    def _resume(self) -> None:
        """Continue the run in OUT from its newest valid checkpoint, or fork from it."""
        cfg, out, done = self.cfg, self.out, self.done
        self._prepare_model()
        if cfg.fork is not None:
            state: dict[str, Any] = {"model": self.model}
            if cfg.fork_optimizer:
                state["optimizer"] = self.optimizer
            done.resumed = fork_from(self.rt, Path(cfg.out or ""), state, fork=cfg.fork)
            done.forked = done.resumed.path
            if cfg.fork_optimizer:  # the loss scale goes with the optimizer's state
                self._load_loss_scale(done.resumed.values)
            return
        lr_given = cfg.lr is not None
        if has_checkpoints(out):
            # Before loading: a model of another shape would fail the load with less to say.
            check_meaning(read_json(out / "config.json"), self._resolved(), lr_given, str(out))
        done.resumed = resumed = self.manager.resume(**self.state)
        if resumed.path is None:
            return
        done.values = values = resumed.values
        saved = values.get("config") if isinstance(values.get("config"), dict) else None
        check_meaning(saved, self._resolved(), lr_given, str(resumed.path))
        done.step = int(values["step"])
        done.train_time = float(values.get("train_time", 0.0))
        done.compile_before = float(values.get("compile_time", 0.0))
        done.samples = int(values.get("samples", 0))
        done.time_before, done.samples_before = done.train_time, done.samples
        self._load_loss_scale(values)
        if saved is not None and not lr_given:
            # The run's own peak learning rate, also at another data-parallel size
            # (where the recipe would scale it to the new global batch).
            self.lr = float(saved.get("lr", self.lr))

    def _load_loss_scale(self, values: dict[str, Any]) -> None:
        """fp16's loss scale as the checkpoint saved it (one saved before it was: none)."""
        if (scaler := self.rt.precision.scaler) is not None and values.get("loss_scale"):
            scaler.load_state_dict(values["loss_scale"])

    def _announce(self) -> None:
        resolved = self._resolved()
        parent = fork_parent(self)
        if parent is not None:
            # A fact of this run, read by people (config.json's `run` section), so that
            # a fork's lineage survives the run it came from being pruned or moved.
            resolved["run"]["forked_from"] = parent
        if self.rt.is_main:
            # Written once the start is accepted: a refused resume leaves it as it was.
            (self.out / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        self.resolved = resolved
        self.observers.on_run_start(run_info(self, resolved))

    # -- training -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._build()
        with _saves_finished(self.manager):
            self._resume()
            self._plan()
            done, resumed = self.done, self.done.resumed
            if resumed is not None and resumed.path is not None and done.forked is None:
                refuse_length(self.cfg, self.out, resumed.path, done.step, self.total_steps)
            self._announce()
            self.run_start_step = done.step
            # A stop asked for during set-up (Ctrl-C while loading) ends the run before the
            # first step: there is nothing new to save.
            done.stopped_by = self.agreement.at_start()
            while done.step < self.total_steps and done.stopped_by is None:
                epoch = self.length.epoch_of(done.step)
                self._train_epoch(epoch)
                if done.stopped_by is None:
                    done.last_eval = self._evaluate(epoch)
            # Nothing trained (resumed at the last step): the checkpoint there stays as it
            # is. A finished run keeps its last step (save_last): extending or forking it
            # needs the optimizer and the loader's position, which model.pt does not hold.
            trained = done.step > self.run_start_step
            if (self.cfg.save_last or done.stopped_by is not None) and trained:
                self._save(final=True)
            if done.stopped_by is not None:
                return self._stopped()
            return self._finish()

    def lr_at(self, step: int) -> float:
        return lr_at(
            step,
            peak=self.lr,
            total_steps=self.total_steps,
            warmup=self.warmup,
            schedule=self.cfg.schedule,
        )

    def _train_epoch(self, epoch: int) -> None:
        cfg, rt, done, observers = self.cfg, self.rt, self.done, self.observers
        first, epoch_end = self.length.span(epoch)
        self.model.train()
        # The same epoch keeps a restored mid-epoch position; a new one restarts.
        self.loader.set_epoch(epoch)
        observers.on_epoch_start(epoch, self.epochs, epoch_end - first, done.step - first)
        batches = TimedBatches(self.loader, first=self.check_batch)
        window_loss = torch.zeros((), device=rt.device)
        window_steps = 0
        window_start = epoch_start = time.perf_counter()
        epoch_samples = 0
        loss_fn: Any = self.recipe.loss
        if self.recipe.loss_fn is not None:  # an error about the loss names the module's
            loss_fn = functools.partial(loss_fn)
            own = self.recipe.loss_fn
            loss_fn.__qualname__ = getattr(own, "__qualname__", type(own).__qualname__)
        while done.step < epoch_end:
            start, waited = time.perf_counter(), batches.wait_s
            lr = self.lr_at(done.step)
            set_lr(self.optimizer, lr)
            loss = train_step(
                rt,
                self.model,
                self.optimizer,
                batches,
                loss_fn,
                accumulate=cfg.accumulate,
                clip_grad=cfg.clip_grad,
                token_loss=self.recipe.token_loss,
            )
            done.step += 1
            epoch_samples += self.global_batch
            observers.on_step_end(
                StepEvent(
                    step=done.step,
                    epoch=epoch,
                    step_in_epoch=done.step - first,
                    steps_in_epoch=epoch_end - first,
                    lr=lr,
                    loss=loss,
                    samples=self.global_batch,
                    start=start,
                    end=time.perf_counter(),
                    data_s=batches.wait_s - waited,
                )
            )
            # Summed on the device; .item() (a GPU sync) only when logging.
            window_loss += loss.to(window_loss.device)
            window_steps += 1
            finished = done.step == epoch_end
            # On the same steps whatever step the run (re)started from: a resumed run's
            # records line up with a straight run's, its first one averaging fewer steps
            # (window_steps says how many).
            if done.step % cfg.log_every == 0 or finished:
                now = time.perf_counter()
                observers.on_log(
                    {
                        "step": done.step,
                        "epoch": epoch,
                        "step_in_epoch": done.step - first,
                        "steps_in_epoch": epoch_end - first,
                        "window_steps": window_steps,
                        "loss": window_loss.item() / window_steps,
                        "lr": lr,
                        "samples_per_s": window_steps
                        * self.global_batch
                        / max(now - window_start, 1e-9),
                    }
                )
                window_loss.zero_()
                window_steps = 0
                window_start = now
            if self._agree_to_stop() or finished:
                break
            if self.manager.due(done.step):
                done.train_time += time.perf_counter() - epoch_start
                done.samples += epoch_samples
                epoch_start, epoch_samples = time.perf_counter(), 0
                self._save()
        # The last step's stop flag, still in flight: every rank collects it here.
        reason = self.agreement.collect()
        if reason is not None:
            done.stopped_by = reason
        done.train_time += time.perf_counter() - epoch_start
        done.samples += epoch_samples
        observers.on_epoch_end(epoch)

    def _agree_to_stop(self) -> bool:
        """Every rank stops at the same step (scaletrain.runtime.stopping)."""
        reason = self.agreement.after_step(
            self.done.step - self.run_start_step, last=self.done.step >= self.total_steps
        )
        if reason is not None:
            self.done.stopped_by = reason
        return self.done.stopped_by is not None

    def compile_time(self) -> float:
        """Seconds this rank spent in torch.compile inside the run's training time."""
        ledger = self.rt.ledger
        return self.done.compile_before + (ledger.compiled.seconds if ledger is not None else 0.0)

    def _save(self, *, final: bool = False) -> Path:
        done = self.done
        values = {
            "train_time": done.train_time,
            "compile_time": self.compile_time(),
            "samples": done.samples,
            # What a later resume compares (settings that alter the run) and reports
            # (extending or shortening).
            "total_steps": self.total_steps,
            "config": self.resolved,
            # Where the step stands in its epoch: a later start plans its length from
            # the checkpoint alone, and refuses a bad one before any process starts.
            **self.length.at_checkpoint(done.step),
        }
        if (scaler := self.rt.precision.scaler) is not None:
            # fp16's loss scale and its count of clean steps toward the next growth: a
            # resume without them starts over from the initial scale, and steps the
            # uninterrupted run took are skipped for overflow (or the other way round).
            values["loss_scale"] = scaler.state_dict()
        handle = self.manager.maybe_save(done.step, force=final, **self.state, **values)
        assert handle is not None
        path = handle if isinstance(handle, Path) else handle.path
        done.saved = path
        self.observers.on_save(done.step, path)
        return path

    def _evaluate(self, epoch: int) -> EvalEvent | None:
        if self.cfg.eval_batches == 0:
            return None
        step = self.done.step
        result = evaluate(
            self.rt,
            self.model,
            self.eval_loader,
            on_batch=lambda: self.observers.on_eval_batch(step),
            max_batches=self.cfg.eval_batches,
            sums=self.recipe.eval_sums,
        )
        classification = self.recipe.task == "classification"
        event = EvalEvent(
            step=step,
            epoch=epoch,
            loss=result.loss,
            accuracy=result.accuracy,
            count=result.count,
            unit="samples" if classification else "tokens",
            metric="val_acc" if classification else "next-token acc",
        )
        self.observers.on_eval(event)
        return event

    # -- the end ----------------------------------------------------------------------
    def _stopped(self) -> dict[str, Any]:
        done, rt = self.done, self.rt
        assert done.stopped_by is not None
        self.observers.on_stop(done.step, self.total_steps, done.stopped_by, done.saved)
        if self.stop.signal is not None or done.stopped_by == "a signal on another rank":
            if rt.is_main:
                (self.out / PREEMPTED_MARKER).write_text(f"{done.step}\n")
            raise Preempted(done.step)
        return {"event": "stopped", "step": done.step, "out": str(self.out)}

    def _finish(self) -> dict[str, Any]:
        done, rt = self.done, self.rt
        if done.last_eval is None and self.cfg.eval_batches != 0:
            # Resumed after the last step: nothing left to train; evaluate once.
            done.last_eval = self._evaluate(max(self.epochs - 1, 0))
        summary = run_summary(self)
        # A collective (it gathers shards and stages): every rank takes part.
        weights = rt.full_state_dict(self.model)
        if rt.is_main:
            # Atomic: model.pt marks a finished run, so it is there whole or not at all.
            save_file(self.out / "model.pt", weights)
        self.observers.on_run_end(summary)
        self.state.clear()
        del self.model, self.optimizer
        return summary
