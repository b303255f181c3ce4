"""What the ranks of a job do together: reduce, gather and broadcast values, agree on a
flag, wait for each other (rt.reduce, rt.gather, rt.any_rank, rt.barrier, ...), on
scaletrain.dist's collectives, each timed as the step ledger's "sync" phase. The base
class of the Runtime, whose API reference lists these with its own; rows.py holds what
rt.gather and rt.gather_for_metrics do to the rows before and after the collective.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from scaletrain import dist as _dist
from scaletrain.data import ShardedLoader
from scaletrain.errors import ConfigError
from scaletrain.observe.metrics import phases as _phases
from scaletrain.observe.metrics.ledger import StepLedger, in_phase
from scaletrain.runtime.place import Place
from scaletrain.runtime.rows import real_rows, rebuild, tensors

__all__ = ["Collectives"]


class Collectives(Place):
    """The Runtime's collectives: every rank calls each at the same point."""

    ledger: StepLedger | None
    _loaders: weakref.WeakSet[ShardedLoader]

    def _phase(self, phase: int, *, mode: bool = False) -> contextlib.AbstractContextManager[None]:
        return in_phase(self.ledger, phase, mode=mode)

    # -- coordination -------------------------------------------------------------
    def reduce(
        self,
        values: Mapping[str, torch.Tensor | float | int],
        op: str = "sum",
        *,
        checked: bool = True,
    ) -> dict[str, Any]:
        """Reduce a dict of tensors/numbers over all ranks in one collective: the same
        names on every rank, each value with as many elements, which one tiny collective
        on the CPU group checks first (`checked=False` skips it, for a dict whose names
        and sizes the code fixes, reduced every step).

        Over every rank: under tensor or pipeline parallelism the ranks of one replica
        read the same batch (`rt.loader` shards between replicas), so a sum of per-sample
        counts holds each sample once per rank of its replica; divide it by
        `rt.world_size // rt.dp_size`, or gather the rows with `rt.gather_for_metrics`,
        which counts each sample once."""
        device = self.device if self.backend == "nccl" else None
        with self._phase(_phases.SYNC):
            return _dist.reduce_values(values, op, device=device, checked=checked)

    def gather(self, data: Any) -> Any:
        """Every rank's tensor, concatenated along dim 0 in rank order: rank 0's rows,
        then rank 1's, ... (Accelerate's `gather`). The first dimension may differ
        between ranks (uneven shards); the other sizes and the dtype may not. A 0-d
        tensor is one row. A dict, list or tuple of tensors gives the same structure,
        each gathered. A collective: every rank calls it, with the same structure.

        Under NCCL the rows travel on this rank's GPU, under Gloo on the CPU; each
        result is on its tensor's device, detached. For metrics over a padded loader,
        `rt.gather_for_metrics` counts every sample once.
        """
        leaves, problem = tensors(data, "rt.gather")
        return rebuild(data, self._gather(leaves, "rt.gather", problem))

    def gather_for_metrics(self, data: Any, loader: ShardedLoader | None = None) -> Any:
        """`rt.gather` less the padding `rt.loader(pad=True)` added, so that every sample
        of the dataset is counted once: predictions, labels, losses per sample.

        `data` has one row per sample (dim 0) of the loader's last batch, called batch by
        batch, or of every batch of its pass, concatenated after the loop. `loader`: the
        loader the rows come from; by default the one of `rt.loader` that handed out a
        batch last. (With pad=False or drop_last there is no padding: this is rt.gather.)
        """
        name = "rt.gather_for_metrics"
        if loader is not None and not isinstance(loader, ShardedLoader):
            raise ConfigError(
                f"{name}(data, loader={type(loader).__name__}): expected the loader the rows "
                "come from, as rt.loader(...) returned it, or no loader (the one that "
                "handed out a batch last)."
            )
        leaves, problem = tensors(data, name)
        # `is None`, not `or`: a loader is falsy when it has no batches (len 0).
        source = (
            loader
            if loader is not None
            else max(self._loaders, key=lambda one: one.handed_out_at, default=None)
        )
        if problem is None and source is not None and source.handed_out_at:
            try:
                leaves = [real_rows(t, source, name) for t in leaves]
            except ConfigError as exc:
                problem = str(exc)
        if problem is None and source is not None and not self._replicas_first_rank():
            # Tensor-parallel and pipeline peers of a replica hold the same batch and the
            # same outputs: its first rank's rows stand for them all.
            leaves = [t[:0] if t.dim() else t.reshape(1)[:0] for t in leaves]
        return rebuild(data, self._gather(leaves, name, problem))

    def _replicas_first_rank(self) -> bool:
        """Whether this rank is the first of its data-parallel replica: at 0 along every
        mesh dimension but "dp" (tensor parallel's, a pipeline's)."""
        mesh = self.topology.mesh_shape
        return all(self.topology.coordinate(d) == 0 for d in mesh if d != "dp")

    def _gather(
        self, leaves: list[torch.Tensor], name: str, problem: str | None
    ) -> list[torch.Tensor]:
        device = self.device if self.backend == "nccl" else None
        with self._phase(_phases.SYNC):
            return _dist.gather_rows(
                leaves, world_size=self.world_size, device=device, name=name, problem=problem
            )

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (pickled; plain data: numbers, strings, lists,
        dicts, CPU tensors), e.g. a choice one rank makes for all. A collective; `src`
        gets its own object back."""
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ConfigError(
                f"rt.broadcast_object(obj, src={src!r}): src is the rank that holds the object, "
                f"an int from 0 to {self.world_size - 1} (world size {self.world_size}). "
                "Fix: src=0, the rank that prints and writes files."
            )
        with self._phase(_phases.SYNC):
            return _dist.broadcast_object(
                obj, src, world_size=self.world_size, name="rt.broadcast_object"
            )

    def rank_zero_first(self, local: bool = True) -> contextlib.AbstractContextManager[None]:
        """Local rank 0 of each node (or global rank 0) runs the block first, others wait."""
        first = self.local_rank == 0 if local else self.rank == 0
        return _dist.rank_first(first)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any: one tiny collective.

        Runs on a CPU (Gloo) group even under NCCL: no GPU synchronisation.
        """
        with self._phase(_phases.SYNC):
            return _dist.any_rank(flag, world_size=self.world_size)

    def any_rank_async(self, flag: bool) -> _dist.PendingFlag:
        """`any_rank` without waiting: returns at once; `.result()` is the same answer on
        every rank. A loop that checks a flag every step starts step k's check and
        collects it at step k+1, so the round trip is off its hot path (one step later)."""
        with self._phase(_phases.SYNC):
            return _dist.any_rank_async(
                flag,
                world_size=self.world_size,
                around=lambda: self._phase(_phases.SYNC),
            )

    def barrier(self) -> None:
        """Wait until every rank reaches this call (a collective)."""
        with self._phase(_phases.SYNC):
            _dist.barrier(self.device)
