"""A DataLoader wrapper that keeps its ShardedSampler's position and epoch current.

A plain DataLoader cannot be checkpointed mid-epoch: with workers it has
already fetched indices ahead of what the training loop has seen, so asking
the sampler "where are we" gives the wrong answer. This wrapper counts the
batches it *hands out* instead, and advances the epoch by itself at the end
of each pass so that forgetting `set_epoch` no longer means training every
epoch on the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from scaletrain.data.sampler import ShardedSampler
from scaletrain.errors import ConfigError, article

__all__ = ["ShardedLoader", "check_dataset"]

_HANDOUTS = itertools.count(1)
"""Numbers the batches every loader of the process hands out: the latest one is the
batch of the loader a loop is iterating (ShardedLoader.handed_out_at)."""


class ShardedLoader:
    """Iterates batches of `dataset` in the order of `sampler`, resumable mid-epoch.

    After each batch is handed out, the sampler's position advances by the
    number of samples in it; a `state_dict()` taken while the training loop
    holds batch k therefore resumes at batch k + 1, whatever `num_workers`
    prefetched. When a pass ends (the iterator is exhausted, not abandoned) it
    calls `sampler.set_epoch(epoch + 1)`, so the next pass reshuffles.

    Worker random seeds are derived from (`seed`, rank, epoch), so random
    augmentations in workers differ between ranks and epochs and are the same
    again after a resume. `seed` defaults to the sampler's seed.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        sampler: ShardedSampler,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        persistent_workers: bool = False,
        seed: int | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(
                f"batch_size={batch_size!r}: the samples per batch on each rank must be a whole "
                "number >= 1. Fix: batch_size=32, say (the global batch is that times the "
                "data-parallel size).",
                field="batch_size",
            )
        if not isinstance(sampler, ShardedSampler):
            raise ConfigError(
                f"ShardedLoader: sampler must be a ShardedSampler, received "
                f"{type(sampler).__name__}; build one with ShardedSampler(dataset, "
                "num_replicas=world_size, rank=rank)"
            )
        n = len(dataset)  # type: ignore[arg-type]
        if n != sampler.dataset_len:
            raise ConfigError(
                f"ShardedLoader: the dataset has {n} samples but the sampler was built for "
                f"{sampler.dataset_len}; build the sampler from this dataset"
            )
        self._dataset = dataset
        self._batch_size = batch_size
        self._sampler = sampler
        self._drop_last = drop_last
        self._seed = sampler.seed if seed is None else int(seed)
        self._generator = torch.Generator()
        # The current pass (one `for` over the loader): which of its samples are padding,
        # how many it has handed out, and how many the last batch had.
        self._pass_padding = torch.zeros(0, dtype=torch.bool)
        self._pass_rows = 0
        self._batch_rows = 0
        self.handed_out_at = 0
        """When this loader last handed out a batch, in the order of every loader's
        batches in this process (0: never)."""
        self._loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=drop_last,
            collate_fn=collate_fn,
            persistent_workers=persistent_workers and num_workers > 0,
            generator=self._generator,
        )

    @property
    def dataset(self) -> Dataset[Any]:
        return self._dataset

    @property
    def sampler(self) -> ShardedSampler:
        return self._sampler

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        """Whether a last partial batch is dropped."""
        return self._drop_last

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Same as `sampler.set_epoch`: a different epoch restarts at its first batch."""
        self._sampler.set_epoch(epoch)

    def _batches(self, samples: int) -> int:
        return samples // self._batch_size if self._drop_last else -(-samples // self._batch_size)

    def __len__(self) -> int:
        """Batches in the current epoch on this rank (ignores the position): a full
        epoch's, or in an epoch resumed at another world size, this rank's share of it."""
        return self._batches(len(self._sampler))

    def remaining(self) -> int:
        """Batches still to come in the current epoch, from the sampler's position."""
        return self._batches(self._sampler.remaining())

    def epoch_done_everywhere(self) -> bool:
        """Whether every rank has handed out all its batches of the current epoch.

        Ranks hand out batches in step, so this rank's count stands for everyone's.
        With pad=False shards differ by one sample, and a rank whose shorter shard is
        used up may still be one batch behind the longest: it stays in this epoch
        (and yields nothing more) until the others are done, so that every rank,
        restored from a checkpoint or not, starts the next epoch on the same pass.
        """
        handed_out = self._batches(self._sampler.position)
        return handed_out >= self._batches(self._sampler.longest_shard())

    def padding(self, rows: int, *, caller: str = "ShardedLoader.padding") -> torch.Tensor:
        """Which of the last `rows` samples this loader handed out are padding (repeats
        that pad=True added so every rank has as many), in the order handed out.

        `rows` is the last batch's samples, or every sample this pass (the current
        `for` over the loader, or the one just finished) handed out: predictions made
        batch by batch, or collected and concatenated at the end.
        """
        if rows == self._batch_rows or rows == self._pass_rows:
            return self._pass_padding[self._pass_rows - rows : self._pass_rows]
        raise ConfigError(
            f"{caller}: received {rows} rows, but the loader's last batch had "
            f"{self._batch_rows} samples and its pass so far {self._pass_rows}; expected one "
            "row per sample of either (dim 0), so that the padding rt.loader(pad=True) "
            "added can be told apart. Fix: pass the batch's outputs as they come, or all of "
            "them concatenated along dim 0 after the loop."
        )

    def state_dict(self) -> dict[str, Any]:
        return self._sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        sampler = self._sampler
        if len(self) > 0 and self.remaining() == 0 and self.epoch_done_everywhere():
            # Every batch of the epoch was handed out, but the consumer stopped at the
            # last one without exhausting the iterator (`if i == last: break`): this
            # pass is the next epoch, not an empty one.
            sampler.set_epoch(sampler.epoch + 1)
        epoch = sampler.epoch
        self._generator.manual_seed(
            int(np.random.SeedSequence([self._seed, sampler.rank, epoch]).generate_state(1)[0])
        )
        self._pass_padding = sampler.padding()[sampler.position :]
        self._pass_rows = self._batch_rows = 0
        for batch in self._loader:
            # Batch sizes follow from the sampler alone (full batches, then a
            # partial one unless drop_last), so no need to inspect what the
            # collate_fn returned, which may be any structure.
            rows = min(self._batch_size, sampler.remaining())
            sampler.advance(rows)
            self._batch_rows = rows
            self._pass_rows += rows
            self.handed_out_at = next(_HANDOUTS)
            yield batch
        sampler.set_epoch(epoch + 1)


def check_dataset(dataset: Any) -> None:
    """rt.loader shards a map-style dataset by index: a DataLoader, an iterable dataset
    or a generator fails at the first batch, inside torch, with torch's words."""
    from torch.utils.data import IterableDataset

    kind = article(type(dataset).__name__)
    if isinstance(dataset, DataLoader):
        raise ConfigError(
            f"rt.loader(dataset, ...): got {kind}; rt.loader makes the loader itself, each "
            "rank taking its shard of the dataset's indices. Fix: pass its dataset "
            "(rt.loader(loader.dataset, batch_size, collate_fn=loader.collate_fn))."
        )
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        raise ConfigError(
            f"rt.loader(dataset, ...): got {kind}; expected a map-style dataset (with "
            "__len__ and __getitem__, e.g. a torch.utils.data.Dataset or a list), whose "
            "indices rt.loader shards between the ranks. Fix: a map-style dataset; a stream "
            "(an IterableDataset, a generator) has no indices to shard: load it into one, "
            "or give each rank its own part of the stream with torch's own DataLoader."
        )
    if isinstance(dataset, dict) and dataset and 0 not in dataset:
        raise ConfigError(
            "rt.loader(dataset, ...): got a dict without the key 0; rt.loader reads samples "
            "by index 0, 1, ... Fix: a list of samples, or a Dataset (e.g. "
            "TensorDataset(inputs, targets))."
        )
