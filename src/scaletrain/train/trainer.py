"""The Trainer behind `scaletrain train`: a plain loop over the public API.

It uses only what a user's own script would (st.init, rt.setup, rt.loader,
rt.reduce), so it doubles as the reference example of the library.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from scaletrain.checkpoint import checkpoint_path, latest_checkpoint
from scaletrain.errors import ConfigError
from scaletrain.runtime import Runtime, init, sync_batchnorm
from scaletrain.train.config import TrainConfig
from scaletrain.train.progress import StepProgress
from scaletrain.train.recipes import get_recipe

__all__ = [
    "EXIT_PREEMPTED",
    "PREEMPTED_MARKER",
    "EvalResult",
    "Preempted",
    "Trainer",
    "evaluate",
    "seed_everything",
    "sync_buffers",
]


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights without a broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float
    accuracy: float
    count: int


@torch.no_grad()
def evaluate(
    rt: Runtime, model: nn.Module, loader: Any, *, on_batch: Callable[[], None] | None = None
) -> EvalResult:
    """Loss and accuracy over a loader built with pad=False: each sample counted once.

    Shards differ by at most one sample, so a rank may have one batch fewer than
    its peers. Strategies whose forward runs collectives (FSDP, tensor, pipeline)
    need every rank to take part in every forward: a rank that ran out repeats its
    last batch and discards the result, so the counts stay exact. `on_batch` runs
    after every batch (the hang watchdog's heartbeat: a long evaluation is progress).
    """
    net = rt.unwrap(model)
    was_training = net.training
    net.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    correct = torch.zeros((), dtype=torch.int64, device=rt.device)
    count = 0
    batches = len(loader)
    most = int(rt.reduce({"batches": batches}, op="max")["batches"])
    last: tuple[Any, torch.Tensor] | None = None
    for x, y in loader:
        last = (x, y)
        x = x.to(rt.device, non_blocking=True)
        outputs = rt.predict(model, x)
        y = y.to(outputs.device, non_blocking=True)
        logits = outputs.reshape(-1, outputs.shape[-1])
        targets = y.reshape(-1)
        loss_sum += (
            nn.functional.cross_entropy(logits, targets, reduction="sum")
            .double()
            .to(loss_sum.device)
        )
        correct += (logits.argmax(dim=1) == targets).sum().to(correct.device)
        count += targets.numel()
        if on_batch is not None:
            on_batch()
    for _ in range(most - batches):
        if last is not None:
            rt.predict(model, last[0].to(rt.device))
    net.train(was_training)
    totals = rt.reduce({"loss_sum": loss_sum, "correct": correct, "count": count}, op="sum")
    # Tensor/pipeline peers of one replica computed the same numbers on the same
    # shard: the sum over all ranks counts each replica's results that many times.
    copies = rt.world_size // rt.dp_size
    n = int(totals["count"]) // copies
    totals["loss_sum"] = totals["loss_sum"] / copies
    totals["correct"] = totals["correct"] // copies
    if n == 0:
        return EvalResult(loss=float("nan"), accuracy=float("nan"), count=0)
    return EvalResult(
        loss=float(totals["loss_sum"]) / n, accuracy=float(totals["correct"]) / n, count=n
    )


@torch.no_grad()
def sync_buffers(rt: Runtime, model: nn.Module) -> None:
    """Average floating buffers (BatchNorm running stats) over ranks.

    DDP broadcasts rank 0's buffers *before* each forward, so after the last
    step every rank holds stats updated by its own last batch. Averaging makes
    evaluation and the saved model the same on every rank.
    """
    if rt.world_size == 1 or rt.dp_size != rt.world_size:
        # With tensor/pipeline peers the buffers are not replicas of each other
        # (pipeline stages hold different layers); only pure data parallel averages.
        return
    net = rt.unwrap(model)
    floats = {n: b for n, b in net.named_buffers() if b.is_floating_point()}
    if not floats:
        return
    reduced = rt.reduce(floats, op="mean")
    for name, buf in floats.items():
        buf.copy_(reduced[name])


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


class _MetricsLog:
    """metrics.jsonl: one JSON object per line, written by rank 0 only."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = path.open("a", encoding="utf-8") if path else None

    def write(self, **record: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


EXIT_PREEMPTED = 75
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after saving (sysexits' EX_TEMPFAIL:
"try again"): requeue it, and the next start resumes from the checkpoint."""


class _StopRequest:
    """Set by SIGTERM / SIGUSR1 (what SLURM sends before it kills a job)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        # Only a flag: the step in flight finishes, every rank agrees, then we save.
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Trainer:
    """Trains a recipe with a strategy; `run()` returns the final summary.

    With an `out` directory that holds checkpoints, it resumes from the newest valid
    one: weights, optimizer, scheduler, loader position (mid-epoch too), every
    rank's RNG and the step counter, so a resumed run ends bitwise equal to an
    uninterrupted one.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.recipe = get_recipe(config.resolved_recipe())

    def run(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.hang_timeout > 0 and cfg.out and torch.cuda.is_available():
            from scaletrain.observe import configure_flight_recorder

            # Before the process group exists: NCCL reads these when it is created.
            configure_flight_recorder(cfg.out)
        rt = init(
            strategy=cfg.strategy,
            backend=cfg.backend,
            mesh=cfg.mesh,
            precision=cfg.precision,
        )
        stop = _StopRequest()
        stop.install()
        try:
            return self._run(rt, stop)
        finally:
            stop.restore()
            rt.shutdown()

    def _run(self, rt: Runtime, stop: _StopRequest) -> dict[str, Any]:
        cfg, recipe = self.config, self.recipe
        epochs_wanted = cfg.epochs or recipe.epochs
        batch_size = cfg.batch_size or recipe.batch_size
        eval_batch_size = cfg.eval_batch_size or recipe.eval_batch_size
        sync_bn = recipe.sync_bn if cfg.sync_bn is None else cfg.sync_bn
        out = Path(cfg.out) if cfg.out else Path("runs") / recipe.name
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            (out / PREEMPTED_MARKER).unlink(missing_ok=True)
        rt.barrier()
        # Where each worker runs, for operators (and the fault-tolerance test) to find it.
        pids = out / "pids"
        pids.mkdir(exist_ok=True)
        (pids / f"rank{rt.rank}.pid").write_text(f"{os.getpid()}\n")
        log = _MetricsLog(out / "metrics.jsonl" if rt.is_main else None)
        progress = StepProgress(enabled=rt.is_main)

        seed_everything(cfg.seed)
        # One rank per node reads (and would download/prepare) first; the others then
        # read the files it checked. A bad file fails on every rank with its message.
        with rt.rank_zero_first():
            train_set = recipe.data(cfg.data_dir, "train")
            test_set = recipe.data(cfg.data_dir, "test")

        model = recipe.build()
        if sync_bn:
            model = sync_batchnorm(model)
        global_batch = batch_size * rt.dp_size * cfg.accumulate
        lr = cfg.lr if cfg.lr is not None else recipe.scaled_lr(global_batch)
        optimizer = recipe.optimizer(model.parameters(), lr)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(train_set, batch_size, shuffle=True, seed=cfg.seed, drop_last=True)
        eval_loader = rt.loader(test_set, eval_batch_size, shuffle=False, pad=False)

        steps_per_epoch = len(loader) // cfg.accumulate
        if steps_per_epoch == 0:
            raise ConfigError(
                f"an epoch of {len(loader)} batch(es) per replica is shorter than "
                f"--accumulate {cfg.accumulate}: no optimizer step would ever run. Lower "
                "--accumulate or --batch-size."
            )
        total_steps = steps_per_epoch * epochs_wanted
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        epochs = math.ceil(total_steps / steps_per_epoch)
        # One-cycle: a short warm-up then cosine decay; 2 epochs of SGD reach >0.90 with it.
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=total_steps, pct_start=0.15
        )
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}

        step, train_time, samples = 0, 0.0, 0
        resumed = latest_checkpoint(out) if (out / "checkpoints").is_dir() else None
        if resumed is not None:
            # Pipeline stages are traced from a batch; build them before loading into them.
            example = next(iter(torch.utils.data.DataLoader(train_set, batch_size=batch_size)))
            rt.prepare(model, example[0].to(rt.device))
            values = rt.load(resumed, **state)
            step = int(values["step"])
            train_time = float(values.get("train_time", 0.0))
            samples = int(values.get("samples", 0))

        layout = f"mesh {rt.mesh_shape}, " if rt.mesh_shape else ""
        extras = [f"precision {cfg.precision}"] if cfg.precision != "32" else []
        if cfg.accumulate > 1:
            extras.append(f"accumulate {cfg.accumulate}")
        progress.print(
            f"scaletrain train: recipe [bold]{recipe.name}[/] on {recipe.dataset} "
            f"({len(train_set):,} train / {len(test_set):,} test samples)\n"
            f"  strategy {cfg.strategy}{' + sync-bn' if sync_bn else ''}, {layout}"
            f"{_plural(rt.world_size, 'process', 'processes')} x {rt.backend} on "
            f"{rt.device.type}, batch {batch_size}/replica x {rt.dp_size}"
            f"{f' x {cfg.accumulate} micro-steps' if cfg.accumulate > 1 else ''} (global "
            f"{global_batch}), lr {lr:g}, {_plural(epochs, 'epoch')}, {total_steps} steps"
            + (f", {', '.join(extras)}" if extras else "")
        )
        if resumed is not None:
            progress.print(f"  resumed from {resumed} at step {step}/{total_steps}")

        def save(*, final: bool = False) -> None:
            values = {"step": step, "train_time": train_time, "samples": samples}
            handle = rt.save(
                checkpoint_path(out, step),
                keep=cfg.keep,
                async_save=cfg.async_save and not final,
                **state,
                **values,
            )
            if final and hasattr(handle, "wait"):
                handle.wait()

        watchdog = None
        if cfg.hang_timeout > 0 and rt.world_size > 1:
            from scaletrain.observe import Watchdog

            watchdog = Watchdog(rt, timeout_s=cfg.hang_timeout, run_dir=out).start()
        stopped_by: str | None = None
        last: EvalResult | None = None
        run_start_step = step
        try:
            with progress:
                while step < total_steps and stopped_by is None:
                    epoch = step // steps_per_epoch
                    epoch_end = min((epoch + 1) * steps_per_epoch, total_steps)
                    model.train()
                    # The same epoch keeps a restored mid-epoch position; a new one restarts.
                    loader.set_epoch(epoch)
                    progress.start_epoch(
                        f"epoch {epoch + 1}/{epochs}",
                        epoch_end - epoch * steps_per_epoch,
                        step - epoch * steps_per_epoch,
                    )
                    window_loss = torch.zeros((), device=rt.device)
                    window_micro = window_steps = 0
                    window_start = epoch_start = time.perf_counter()
                    epoch_samples = 0
                    for x, y in loader:
                        x = x.to(rt.device, non_blocking=True)
                        with rt.accumulate(model, steps=cfg.accumulate) as micro:
                            loss = rt.forward_backward(model, x, y, recipe.loss)
                        # Summed on the device; .item() (a GPU sync) only when logging.
                        window_loss += loss.to(window_loss.device)
                        window_micro += 1
                        if not micro.sync:
                            continue
                        if cfg.clip_grad is not None:
                            rt.clip_grad_norm(model, optimizer, cfg.clip_grad)
                        rt.step(optimizer)
                        optimizer.zero_grad(set_to_none=True)
                        scheduler.step()
                        step += 1
                        window_steps += 1
                        epoch_samples += global_batch
                        if watchdog is not None:
                            watchdog.beat(step)
                        done = step == epoch_end
                        if window_steps == cfg.log_every or done:
                            now = time.perf_counter()
                            mean_loss = window_loss.item() / window_micro
                            speed = window_steps * global_batch / max(now - window_start, 1e-9)
                            progress.update(
                                step - epoch * steps_per_epoch,
                                epoch_end - epoch * steps_per_epoch,
                                mean_loss,
                                speed,
                            )
                            log.write(
                                event="train",
                                step=step,
                                epoch=epoch + 1,
                                loss=mean_loss,
                                lr=scheduler.get_last_lr()[0],
                                samples_per_s=speed,
                            )
                            window_loss.zero_()
                            window_micro = window_steps = 0
                            window_start = now
                        # Every rank must stop at the same step: agree with one tiny
                        # collective (a preemption signal reaches ranks at different times).
                        wants_stop = stop.signal is not None or (
                            cfg.stop_after is not None and step - run_start_step >= cfg.stop_after
                        )
                        if rt.any_rank(wants_stop):
                            stopped_by = "signal" if stop.signal is not None else "stop_after"
                        if stopped_by is not None or done:
                            break
                        if cfg.save_every and step % cfg.save_every == 0:
                            train_time += time.perf_counter() - epoch_start
                            samples += epoch_samples
                            epoch_start, epoch_samples = time.perf_counter(), 0
                            save()
                    train_time += time.perf_counter() - epoch_start
                    samples += epoch_samples
                    progress.end_epoch()
                    if stopped_by is not None:
                        break
                    beat = None
                    if watchdog is not None:
                        # Each evaluation batch is progress: a long evaluation is no hang.
                        beat = functools.partial(watchdog.beat, step, "eval")
                        beat()
                    sync_buffers(rt, model)
                    last = evaluate(rt, model, eval_loader, on_batch=beat)
                    if watchdog is not None:
                        watchdog.beat(step, "step")
                    metric = "val_acc" if recipe.task == "classification" else "next-token acc"
                    progress.print(
                        f"epoch {epoch + 1}/{epochs}: val_loss {last.loss:.4f}  "
                        f"{metric} {last.accuracy:.4f}  ({last.count:,} "
                        f"{'samples' if recipe.task == 'classification' else 'tokens'}, "
                        "all ranks)"
                    )
                    log.write(
                        event="eval",
                        step=step,
                        epoch=epoch + 1,
                        val_loss=last.loss,
                        val_acc=last.accuracy,
                        count=last.count,
                    )
        finally:
            if watchdog is not None:
                watchdog.stop()

        if cfg.save_every is not None or stopped_by is not None:
            save(final=True)
        if stopped_by is not None:
            log.close()
            why = (
                f"signal {signal.Signals(stop.signal).name}"
                if stop.signal is not None
                else f"--stop-after {cfg.stop_after}"
            )
            progress.print(
                f"stopped at step {step}/{total_steps} ({why}); saved "
                f"{checkpoint_path(out, step)}. Run the same command again to resume."
            )
            if stop.signal is not None:
                if rt.is_main:
                    (out / PREEMPTED_MARKER).write_text(f"{step}\n")
                raise Preempted(step)
            return {"event": "stopped", "step": step, "out": str(out)}

        if last is None:
            # Resumed after the last step: nothing left to train; evaluate once.
            sync_buffers(rt, model)
            last = evaluate(rt, model, eval_loader)
        summary = {
            "event": "summary",
            "recipe": recipe.name,
            "strategy": cfg.strategy,
            "mesh": rt.mesh_shape,
            "world_size": rt.world_size,
            "backend": rt.backend,
            "device": rt.device.type,
            "steps": step,
            "epochs": epochs,
            "train_time_s": train_time,
            "samples_per_s": samples / max(train_time, 1e-9),
            "val_loss": last.loss,
            "val_acc": last.accuracy,
            "out": str(out),
        }
        log.write(**summary)
        log.close()
        # A collective (it gathers shards and stages): every rank takes part.
        weights = rt.full_state_dict(model)
        if rt.is_main:
            torch.save(weights, out / "model.pt")
        progress.print(
            f"done: {step} steps in {train_time:.1f} s, {summary['samples_per_s']:,.0f} samples/s "
            f"over {_plural(rt.world_size, 'process', 'processes')}; "
            f"{'test accuracy' if recipe.task == 'classification' else 'next-token accuracy'} "
            f"{last.accuracy:.4f}, loss {last.loss:.4f}. "
            f"Wrote {out}/metrics.jsonl and {out}/model.pt"
        )
        state.clear()
        del model, optimizer
        return summary


PREEMPTED_MARKER = "PREEMPTED"
"""File rank 0 writes into the run directory when a signal stopped the run."""


class Preempted(Exception):
    """The run saved and stopped on SIGTERM/SIGUSR1; exit with EXIT_PREEMPTED."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted at step {step}; checkpoint saved")
        self.step = step
