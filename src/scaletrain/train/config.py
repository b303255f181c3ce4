"""Configuration of a `scaletrain train` run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scaletrain.errors import ConfigError

__all__ = ["TrainConfig"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything `scaletrain train` needs; each CLI flag maps to one field."""

    recipe: str | None = None
    """Model + data recipe (scaletrain.train.recipes); None: convnet (gpt for "tensor")."""
    nproc: int | None = None
    """Processes on this node; None: one per GPU, else 2 on CPU."""
    epochs: int | None = None
    """Passes over the training set; None: the recipe's default."""
    max_steps: int | None = None
    """Stop after this many optimiser steps (for smoke tests); None: run all epochs."""
    batch_size: int | None = None
    """Samples per replica per step (global batch = batch_size x data-parallel size);
    None: the recipe's default."""
    lr: float | None = None
    """Peak learning rate; None: the recipe's, scaled linearly with the global batch."""
    strategy: str = "ddp"
    """Parallelism strategy name."""
    mesh: str | None = None
    """Device mesh such as "dp=2,tp=2": composes the strategy with tensor/pipeline."""
    sync_bn: bool | None = None
    """Convert BatchNorm to SyncBatchNorm; None: the recipe's default."""
    backend: str | None = None
    """"nccl", "gloo" or None (NCCL on GPUs, Gloo on CPUs)."""
    data_dir: str | None = None
    """Directory with the dataset files; None: search the usual places."""
    out: str | None = None
    """Run directory for metrics.jsonl and model.pt; None: runs/<recipe>-<time>."""
    seed: int = 0
    """Seed for weights, shuffling and augmentation: same seed, same run."""
    eval_batch_size: int | None = None
    """Samples per rank per evaluation step; None: the recipe's default."""
    log_every: int = 20
    """Steps between metric records (and plain-text progress lines)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    precision: str = "32"
    """"32", "bf16-mixed", "fp16-mixed" (CUDA) or "bf16-true"."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    clip_grad: float | None = None
    """Clip gradients to this whole-model norm; None: no clipping."""
    save_every: int | None = None
    """Save a checkpoint every this many optimizer steps (and at the end); None: at the end."""
    keep: int = 3
    """Checkpoints kept in <out>/checkpoints (older ones are pruned)."""
    async_save: bool = False
    """Write sharded checkpoints in the background while training continues."""
    stop_after: int | None = None
    """Stop this run after this many optimizer steps (saving); a later start resumes."""
    max_restarts: int = 0
    """Restart all workers this many times after a failure; they resume from a checkpoint."""
    hang_timeout: float = 300.0
    """Seconds without progress on some rank before the job fails with a diagnosis; 0: off."""

    def __post_init__(self) -> None:
        positive = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "eval_batch_size": self.eval_batch_size,
            "log_every": self.log_every,
        }
        for field, value in positive.items():
            if value is not None and value < 1:
                raise ConfigError(f"{field}={value!r} must be a positive integer (>= 1).")
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"nproc={self.nproc!r} must be >= 1 (processes on this node).")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps!r} must be >= 1, or unset.")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be a positive number, e.g. 0.05.")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers={self.num_workers!r} must be >= 0.")
        if self.accumulate < 1:
            raise ConfigError(f"accumulate={self.accumulate!r} must be >= 1 (1: no accumulation).")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"clip_grad={self.clip_grad!r} must be a positive norm, e.g. 1.0.")
        for name in ("save_every", "stop_after"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value!r} must be >= 1 steps, or unset.")
        if self.keep < 1:
            raise ConfigError(f"keep={self.keep!r} must be >= 1 checkpoints.")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be >= 0.")
        if self.hang_timeout < 0:
            raise ConfigError(f"hang_timeout={self.hang_timeout!r} must be >= 0 s (0: off).")

    def resolved_recipe(self) -> str:
        """The recipe to run: the one asked for, else the default for the strategy."""
        if self.recipe is not None:
            return self.recipe
        # Tensor parallel shards Linear pairs; the default ConvNet has none, the GPT does.
        return "gpt" if self.strategy == "tensor" or "tp=" in (self.mesh or "") else "convnet"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
