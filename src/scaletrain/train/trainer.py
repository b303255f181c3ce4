"""The Trainer behind `scaletrain train`: a plain loop over the public API.

It uses only what a user's own script would (st.init, rt.setup, rt.loader,
rt.reduce), so it doubles as the reference example of the library.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from scaletrain.runtime import Runtime, init, sync_batchnorm
from scaletrain.train.config import TrainConfig
from scaletrain.train.progress import StepProgress
from scaletrain.train.recipes import get_recipe

__all__ = ["EvalResult", "Trainer", "evaluate", "seed_everything", "sync_buffers"]


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
def evaluate(rt: Runtime, model: nn.Module, loader: Any) -> EvalResult:
    """Loss and accuracy over a loader built with pad=False: each sample counted once.

    Shards differ by at most one sample, so a rank may have one batch fewer than
    its peers. Strategies whose forward runs collectives (FSDP, tensor, pipeline)
    need every rank to take part in every forward: a rank that ran out repeats its
    last batch and discards the result, so the counts stay exact.
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


class Trainer:
    """Trains a recipe with a strategy; `run()` returns the final summary."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.recipe = get_recipe(config.resolved_recipe())

    def run(self) -> dict[str, Any]:
        cfg = self.config
        rt = init(strategy=cfg.strategy, backend=cfg.backend, mesh=cfg.mesh)
        try:
            return self._run(rt)
        finally:
            rt.shutdown()

    def _run(self, rt: Runtime) -> dict[str, Any]:
        cfg, recipe = self.config, self.recipe
        epochs_wanted = cfg.epochs or recipe.epochs
        batch_size = cfg.batch_size or recipe.batch_size
        eval_batch_size = cfg.eval_batch_size or recipe.eval_batch_size
        sync_bn = recipe.sync_bn if cfg.sync_bn is None else cfg.sync_bn
        out = Path(cfg.out) if cfg.out else Path("runs") / recipe.name
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
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
        global_batch = batch_size * rt.dp_size
        lr = cfg.lr if cfg.lr is not None else recipe.scaled_lr(global_batch)
        optimizer = recipe.optimizer(model.parameters(), lr)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(train_set, batch_size, shuffle=True, seed=cfg.seed, drop_last=True)
        eval_loader = rt.loader(test_set, eval_batch_size, shuffle=False, pad=False)

        steps_per_epoch = len(loader)
        total_steps = steps_per_epoch * epochs_wanted
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        epochs = math.ceil(total_steps / steps_per_epoch)
        # One-cycle: a short warm-up then cosine decay; 2 epochs of SGD reach >0.90 with it.
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=total_steps, pct_start=0.15
        )
        layout = f"mesh {rt.mesh_shape}, " if rt.mesh_shape else ""
        progress.print(
            f"scaletrain train: recipe [bold]{recipe.name}[/] on {recipe.dataset} "
            f"({len(train_set):,} train / {len(test_set):,} test samples)\n"
            f"  strategy {cfg.strategy}{' + sync-bn' if sync_bn else ''}, {layout}"
            f"{_plural(rt.world_size, 'process', 'processes')} x {rt.backend} on "
            f"{rt.device.type}, batch {batch_size}/replica x {rt.dp_size} (global "
            f"{global_batch}), lr {lr:g}, {_plural(epochs, 'epoch')}, {total_steps} steps"
        )

        step = 0
        train_time = 0.0
        samples = 0
        last: EvalResult | None = None
        with progress:
            for epoch in range(epochs):
                model.train()
                loader.set_epoch(epoch)
                steps_this_epoch = min(steps_per_epoch, total_steps - step)
                progress.start_epoch(f"epoch {epoch + 1}/{epochs}", steps_this_epoch)
                window_loss = torch.zeros((), device=rt.device)
                window_steps = 0
                window_start = time.perf_counter()
                epoch_start = window_start
                for i, (x, y) in enumerate(loader):
                    x = x.to(rt.device, non_blocking=True)
                    optimizer.zero_grad(set_to_none=True)
                    loss = rt.forward_backward(model, x, y, recipe.loss)
                    optimizer.step()
                    scheduler.step()
                    step += 1
                    window_steps += 1
                    # Accumulate on the device; reading it back (.item()) syncs a GPU,
                    # so it happens only when a record is written.
                    window_loss += loss.to(window_loss.device)
                    done = i + 1 == steps_this_epoch
                    if window_steps == cfg.log_every or done:
                        now = time.perf_counter()
                        mean_loss = window_loss.item() / window_steps
                        speed = window_steps * global_batch / max(now - window_start, 1e-9)
                        progress.update(i + 1, steps_this_epoch, mean_loss, speed)
                        log.write(
                            event="train",
                            step=step,
                            epoch=epoch + 1,
                            loss=mean_loss,
                            lr=scheduler.get_last_lr()[0],
                            samples_per_s=speed,
                        )
                        window_loss.zero_()
                        window_steps = 0
                        window_start = now
                    if done:
                        break
                train_time += time.perf_counter() - epoch_start
                progress.end_epoch()
                samples += steps_this_epoch * global_batch
                sync_buffers(rt, model)
                last = evaluate(rt, model, eval_loader)
                metric = "val_acc" if recipe.task == "classification" else "next-token acc"
                progress.print(
                    f"epoch {epoch + 1}/{epochs}: val_loss {last.loss:.4f}  "
                    f"{metric} {last.accuracy:.4f}  ({last.count:,} "
                    f"{'samples' if recipe.task == 'classification' else 'tokens'}, all ranks)"
                )
                log.write(
                    event="eval",
                    step=step,
                    epoch=epoch + 1,
                    val_loss=last.loss,
                    val_acc=last.accuracy,
                    count=last.count,
                )

        assert last is not None
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
        state = rt.full_state_dict(model)
        if rt.is_main:
            torch.save(state, out / "model.pt")
        progress.print(
            f"done: {step} steps in {train_time:.1f} s, {summary['samples_per_s']:,.0f} samples/s "
            f"over {_plural(rt.world_size, 'process', 'processes')}; "
            f"{'test accuracy' if recipe.task == 'classification' else 'next-token accuracy'} "
            f"{last.accuracy:.4f}, loss {last.loss:.4f}. "
            f"Wrote {out}/metrics.jsonl and {out}/model.pt"
        )
        del model, optimizer
        return summary
