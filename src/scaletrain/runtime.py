"""`scaletrain.init()` and the Runtime it returns: the whole public training API."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import torch
from torch import nn

from scaletrain import dist as _dist
from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.env import detect
from scaletrain.env.base import ClusterEnv
from scaletrain.strategies import Strategy, resolve_strategy

__all__ = ["Runtime", "init"]

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class Runtime:
    """This process's place in the job and the tools to train in it.

    Made by `scaletrain.init()`; holds the detected environment, the process group,
    the device and the strategy.
    """

    def __init__(
        self, *, env: ClusterEnv, strategy: Strategy, backend: str, device: torch.device
    ) -> None:
        self.env = env
        self.strategy = strategy
        self.backend = backend
        self.device = device
        self._closed = False

    # -- where am I ------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one that prints, logs and writes files."""
        return self.env.rank == 0

    def __repr__(self) -> str:
        return (
            f"Runtime(rank={self.rank}, local_rank={self.local_rank}, "
            f"world_size={self.world_size}, backend={self.backend!r}, device={self.device}, "
            f"strategy={type(self.strategy).__name__}, env={self.env.kind!r})"
        )

    # -- model ------------------------------------------------------------------
    @overload
    def setup(self, model: nn.Module) -> nn.Module: ...

    @overload
    def setup(self, model: nn.Module, optimizer: OptimizerT) -> tuple[nn.Module, OptimizerT]: ...

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this process's device and wrap it for the strategy."""
        wrapped = self.strategy.setup_module(model, self)
        if optimizer is None:
            return wrapped
        return wrapped, self.strategy.setup_optimizer(optimizer, wrapped, self)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper setup() added."""
        return self.strategy.unwrap(model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient all-reduce inside the block (accumulation micro-steps)."""
        return self.strategy.no_sync(model)

    # -- data -------------------------------------------------------------------
    def loader(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> ShardedLoader:
        """A loader giving this rank its shard, reshuffled each epoch, resumable mid-epoch.

        For evaluation pass `shuffle=False, pad=False`: shards then differ by at most
        one sample and every sample is counted exactly once across ranks.
        """
        rank, size = self.strategy.data_parallel(self)
        sampler = ShardedSampler(
            dataset,
            num_replicas=size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=pad,
        )
        return ShardedLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            drop_last=drop_last,
            collate_fn=collate_fn,
        )

    # -- coordination -------------------------------------------------------------
    def reduce(
        self, values: Mapping[str, torch.Tensor | float | int], op: str = "sum"
    ) -> dict[str, Any]:
        """Reduce a dict of tensors/numbers over all ranks in one collective."""
        device = self.device if self.backend == "nccl" else None
        return _dist.reduce_values(values, op, device=device)

    def rank_zero_first(self, local: bool = True) -> contextlib.AbstractContextManager[None]:
        """Local rank 0 of each node (or global rank 0) runs the block first, others wait."""
        first = self.local_rank == 0 if local else self.rank == 0
        return _dist.rank_first(first, device=self.device)

    def barrier(self) -> None:
        _dist.barrier(self.device)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def shutdown(self) -> None:
        """Leave the job cleanly; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _dist.destroy()
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_CURRENT: Runtime | None = None


def init(
    strategy: str | Strategy | None = "ddp",
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout: float = _dist.DEFAULT_TIMEOUT_S,
    env: ClusterEnv | str | None = None,
) -> Runtime:
    """Detect the environment, join the process group, pin the device.

    strategy: a name ("ddp", "single") or a strategy object (st.DDP(...)).
    backend: "nccl" / "gloo" / None for NCCL on GPUs and Gloo on CPUs.
    device: override the device ("cpu", "cuda:1"); default one GPU per local rank.
    timeout: seconds a collective may wait for a peer before failing.
    env: a ClusterEnv, or the name of a kind to force ("slurm"); default: detect.
    """
    global _CURRENT
    cluster = env if isinstance(env, ClusterEnv) else detect(kind=env)
    chosen = _dist.choose_backend(backend)
    dev = _dist.choose_device(cluster.local_rank, backend=chosen, device=device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    strat = resolve_strategy(strategy)
    rt = Runtime(env=cluster, strategy=strat, backend=chosen, device=dev)
    # Check the strategy before any peer is contacted: a bad config fails fast, alone.
    strat.validate(rt)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _dist.init_process_group(cluster, backend=chosen, device=dev, timeout_s=timeout)
    _CURRENT = rt
    return rt
