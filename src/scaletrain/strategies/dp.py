"""nn.DataParallel: one process drives every local GPU (the seeds' first example).

Kept because it is the one-line start the seeds teach. DistributedDataParallel
(strategy="ddp", one process per GPU) is faster, and the PyTorch docs recommend
it over DataParallel: DataParallel runs every replica from one Python thread
(the GIL serialises them), copies the model to every GPU on every forward,
scatters inputs and gathers outputs through the first GPU, and leaves that GPU
doing more work and holding more memory than the others. DDP replicates once,
overlaps the gradient all-reduce with the backward, and also scales to many nodes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from scaletrain.errors import ConfigError, spell
from scaletrain.strategies.base import Strategy, register

if TYPE_CHECKING:
    from scaletrain.dist.topology import Topology

__all__ = ["DataParallel"]

# Warn once per process: a training script calls setup() once, but tests and
# notebooks call it many times and the message does not change.
_warned_no_gpu = False


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@register
@dataclass(kw_only=True, slots=True)
class DataParallel(Strategy):
    """Replicate the model over this machine's GPUs in ONE process (torch's nn.DataParallel).

    Each forward splits the batch along dim 0 over `device_ids`, runs the replicas
    in threads and gathers the outputs on the first GPU. Slower than strategy="ddp"
    with one process per GPU (see the module docstring). Without a GPU the model
    runs as is on the CPU, with one warning per process.
    """

    name: ClassVar[str] = "dp"

    device_ids: list[int] | None = None
    """GPU indices to replicate over; None: every visible GPU. The model lives on the first."""

    def __post_init__(self) -> None:
        Strategy.__post_init__(self)
        if self.float8:
            raise ConfigError(
                f"{spell('strategy', 'dp')} takes no {spell('float8')}: nn.DataParallel copies "
                "the model into each GPU's replica at every step, float8's layers and all. "
                f"Fix: {spell('strategy', 'ddp')} (one process per GPU), which takes it and is "
                "faster.",
                field="float8",
            )
        if self.uses_levers:
            # Its replicas are copied from the model at every forward, in threads:
            # checkpoint wrappers and compiled blocks are not made to be copied so.
            raise ConfigError(
                f"{spell('strategy', 'dp')} takes no {spell('ac')} or {spell('compile')}: "
                "nn.DataParallel copies the model into each GPU's replica at every step. "
                f"Fix: {spell('strategy', 'ddp')} (one process per GPU), which takes them "
                "and is faster.",
                field="strategy",
            )
        if self.device_ids is None:
            return
        ids = list(self.device_ids)
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise ConfigError(
                f"DataParallel(device_ids={self.device_ids!r}) must be a non-empty list of "
                "GPU indices such as [0, 1], or None for every visible GPU."
            )
        if len(set(ids)) != len(ids):
            raise ConfigError(
                f"DataParallel(device_ids={self.device_ids!r}) repeats a GPU; list each once, "
                "e.g. [0, 1]."
            )
        self.device_ids = ids

    def _validate(self, topo: Topology) -> None:
        if topo.world_size > 1:
            raise ConfigError(
                f"strategy 'dp' (nn.DataParallel) drives all GPUs from a single process, but "
                f"this job has {topo.world_size} processes (world size {topo.world_size}, "
                f"backend {topo.backend!r}): every process would replicate over every GPU. Use "
                "strategy='ddp' with one process per GPU (torchrun --nproc-per-node N), which "
                "is also faster, or start a single process for 'dp'."
            )
        count = _gpu_count()
        if self.device_ids is not None and count and max(self.device_ids) >= count:
            raise ConfigError(
                f"DataParallel(device_ids={self.device_ids}) names GPU {max(self.device_ids)}, "
                f"but this machine has {count} visible GPU(s) (0 .. {count - 1}). Use indices "
                "below that, None for all of them, or check CUDA_VISIBLE_DEVICES."
            )

    def _setup_module(self, module: nn.Module, topo: Topology) -> nn.Module:
        count = _gpu_count()
        if count == 0:
            _warn_no_gpu()
            return module.to(topo.device)
        ids = self.device_ids if self.device_ids is not None else list(range(count))
        # nn.DataParallel requires the parameters on device_ids[0] before it replicates.
        module = module.to(torch.device("cuda", ids[0]))
        return nn.DataParallel(module, device_ids=ids)

    def unwrap(self, module: nn.Module) -> nn.Module:
        # Checkpoints then hold the user's keys, not DataParallel's "module." prefix.
        return module.module if isinstance(module, nn.DataParallel) else module

    def _predict(self, module: nn.Module, inputs: Any) -> Any:
        # DataParallel runs no collective: evaluation may split the batch too.
        return module(inputs)


def _warn_no_gpu() -> None:
    global _warned_no_gpu
    if _warned_no_gpu:
        return
    _warned_no_gpu = True
    warnings.warn(
        "strategy 'dp' (nn.DataParallel) found no CUDA GPU: the model runs as is, on the CPU, "
        "in this one process. DataParallel only splits batches over GPUs; on CPUs use "
        "strategy='ddp' with several processes (torchrun --nproc-per-node N).",
        UserWarning,
        stacklevel=4,
    )
