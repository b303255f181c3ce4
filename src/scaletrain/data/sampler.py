"""A distributed sampler that shards an index range across ranks and resumes mid-epoch.

It produces the same order as `torch.utils.data.DistributedSampler` for the same
seed and epoch (so switching to it changes no result), and adds what that
sampler lacks for long jobs: a consumed-`position` inside the epoch that is
saved in `state_dict` and honoured by `__iter__`, an evaluation mode
(`pad=False`) where every sample is seen exactly once across all ranks, and
resharding: an epoch interrupted at one world size goes on at another with the
samples no rank had reached (`reshard`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from scaletrain.errors import ConfigError

__all__ = ["ShardedSampler", "reshard", "resume_state"]

# Keys a state_dict must hold. Kept as a tuple so the error for a foreign or
# truncated state can list them.
_STATE_KEYS = (
    "epoch",
    "position",
    "seed",
    "num_replicas",
    "shuffle",
    "drop_last",
    "pad",
    "dataset_len",
)


class ShardedSampler(Sampler[int]):
    """Yields this rank's share of the indices 0..N-1, in an order fixed by (seed, epoch).

    Each epoch the indices are permuted by a `torch.Generator` seeded with
    `seed + epoch` (when `shuffle`), then made to divide by `num_replicas`:

    * `drop_last=True`: the tail is dropped (every rank gets N // R indices);
    * else `pad=True`: indices are repeated from the start, wrapping around as
      often as needed (also when N < R), so every rank gets ceil(N / R);
    * else (`pad=False`, evaluation): nothing is added or dropped, every index
      appears exactly once over all ranks, and shard lengths differ by at most one.

    Rank r takes `indices[r::num_replicas]`, as DistributedSampler does.

    Resuming: `position` counts how many of this rank's indices were consumed in
    the current epoch; `__iter__` starts there. The consumer (`ShardedLoader`)
    calls `advance(n)` as batches are handed out. When an epoch is finished the
    position stays at `len(self)` (so a state saved then says "epoch done")
    until `set_epoch` is called with a *different* epoch, which resets it to 0.
    Calling `set_epoch` with the current epoch keeps the position: the usual
    `for epoch in range(start, n): sampler.set_epoch(epoch)` loop therefore
    does not throw away a restored mid-epoch position.
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if n < 0:
            raise ConfigError(
                f"ShardedSampler: dataset length must be >= 0, received {n}; "
                "pass a dataset or its number of samples"
            )
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(
                f"ShardedSampler: num_replicas must be an int >= 1, received {num_replicas!r}; "
                "pass the world size (dist.get_world_size())"
            )
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ConfigError(
                f"ShardedSampler: rank must be an int in [0, {num_replicas - 1}] "
                f"(num_replicas={num_replicas}), received {rank!r}; pass dist.get_rank()"
            )
        self._n = n
        self._num_replicas = num_replicas
        self._rank = rank
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._drop_last = bool(drop_last)
        self._pad = bool(pad)
        self._epoch = 0
        self._position = 0
        # Resharding of the current epoch: each earlier layout of it (its world size and
        # how far each of its ranks got), oldest first. Empty for an ordinary epoch.
        self._layers: list[dict[str, Any]] = []
        self._cache: tuple[Any, ...] | None = None

    # -- read-only settings ------------------------------------------------

    @property
    def dataset_len(self) -> int:
        """Number of samples in the dataset (N)."""
        return self._n

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def pad(self) -> bool:
        return self._pad

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """How many of this rank's indices were consumed in the current epoch."""
        return self._position

    @property
    def total_size(self) -> int:
        """Indices over all ranks in one epoch, after dropping or padding."""
        n, r = self._n, self._num_replicas
        if self._drop_last:
            return n - n % r
        if self._pad:
            return -(-n // r) * r
        return n

    def remaining(self) -> int:
        """Indices this rank still has to yield in the current epoch."""
        return len(self) - self._position

    def _shard_len(self, n: int, rank: int) -> int:
        r = self._num_replicas
        if self._drop_last:
            return n // r
        if self._pad:
            return -(-n // r)
        # Eval mode: rank r holds positions r, r+R, ... < n.
        return max(0, -(-(n - rank) // r))

    def __len__(self) -> int:
        """Indices this rank yields in the current epoch (ignores `position`).

        That is len(dataset) / world size, rounded as drop_last/pad say, except in an
        epoch resumed at another world size: then this rank's share of what was left.
        """
        if self._layers:
            return len(self._resharded()[0])
        return self._shard_len(self._n, self._rank)

    def longest_shard(self) -> int:
        """The most indices any rank has in the current epoch (rank 0's with pad=False)."""
        if self._layers:
            return self._resharded()[1]
        return self._shard_len(self._n, 0)

    # -- epoch / progress --------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation for `epoch`; a new epoch restarts at position 0."""
        epoch = int(epoch)
        if epoch < 0:
            raise ConfigError(f"ShardedSampler.set_epoch: epoch must be >= 0, received {epoch}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0
            self._layers = []
            self._cache = None

    def advance(self, n: int) -> None:
        """Record that `n` more of this rank's indices were consumed."""
        if n < 0 or self._position + n > len(self):
            raise ConfigError(
                f"ShardedSampler.advance({n}): position would become {self._position + n}, "
                f"expected 0 <= position <= {len(self)} (indices this rank has per epoch)"
            )
        self._position += n

    def _fit(self, order: torch.Tensor, replicas: int) -> torch.Tensor:
        """`order` cut (drop_last) or repeated cyclically (pad) to divide by `replicas`."""
        n = len(order)
        if self._drop_last:
            return order[: n - n % replicas]
        total = -(-n // replicas) * replicas
        if self._pad and n and total > n:
            # Cyclic repetition equals DistributedSampler's padding in both of its
            # branches (padding shorter or longer than the data).
            return order[torch.arange(total) % n]
        return order

    def _fit_ids(self, ids: torch.Tensor, replicas: int) -> torch.Tensor:
        """`_fit` on positions in the epoch's order: the k-th repeat of position p comes
        back as p + k * N, so an id >= N is padding and id % N is the position it repeats."""
        n = len(ids)
        if self._drop_last:
            return ids[: n - n % replicas]
        total = -(-n // replicas) * replicas
        if self._pad and n and total > n:
            at = torch.arange(total)
            return ids[at % n] + (at // n) * self._n
        return ids

    def _order(self, epoch: int) -> torch.Tensor:
        if self._shuffle:
            g = torch.Generator()
            g.manual_seed(self._seed + epoch)
            return torch.randperm(self._n, generator=g)
        return torch.arange(self._n)

    def _resharded(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(this rank's indices, the longest rank's count, which of its indices are
        padding) in a resharded epoch. Dealt as positions in the epoch's order (see
        `_fit_ids`), so the repeats of every layout stay known as padding."""
        key = (self._epoch, self._rank, self._num_replicas, repr(self._layers))
        if self._cache is None or self._cache[0] != key:
            replicas = int(self._layers[0]["num_replicas"])
            shards = _split(self._fit_ids(torch.arange(self._n), replicas), replicas)
            for i, layer in enumerate(self._layers):
                left = reshard(shards, [int(p) for p in layer["positions"]])
                after = (
                    int(self._layers[i + 1]["num_replicas"])
                    if i + 1 < len(self._layers)
                    else self._num_replicas
                )
                shards = _split(self._fit_ids(left, after), after)
            ids = shards[self._rank]
            mine = self._order(self._epoch)[ids % max(self._n, 1)]
            longest = max((len(s) for s in shards), default=0)
            self._cache = (key, mine, longest, ids >= self._n)
        return self._cache[1], self._cache[2], self._cache[3]

    def padding(self) -> torch.Tensor:
        """Which of this rank's indices of the current epoch (`indices()`, in order) are
        padding: repeats that `pad=True` added so that every rank has as many. Dropping
        them over every rank counts each sample once (rt.gather_for_metrics does)."""
        if self._layers:
            return self._resharded()[2]
        # Rank r's j-th index is position j * R + r of the padded order; those past N
        # are the repeats (none with drop_last or pad=False, whose shards fit N).
        positions = torch.arange(len(self)) * self._num_replicas + self._rank
        return positions >= self._n

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """All of this rank's indices for `epoch` (default: current), ignoring position."""
        epoch = self._epoch if epoch is None else epoch
        if self._layers and epoch == self._epoch:
            return self._resharded()[0]
        return self._fit(self._order(epoch), self._num_replicas)[self._rank :: self._num_replicas]

    def __iter__(self) -> Iterator[int]:
        # Computed eagerly so that the epoch and position are those at the time
        # iter() is called (DataLoader calls it when its own iterator is made),
        # not at the first next(), which a prefetching consumer may delay.
        return iter(self.indices()[self._position :].tolist())

    # -- checkpointing -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Progress and the settings that fix the order, for `load_state_dict`."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "num_replicas": self._num_replicas,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "pad": self._pad,
            "dataset_len": self._n,
            "reshard": [dict(layer) for layer in self._layers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore epoch and position saved by `state_dict`.

        A mid-epoch position is only meaningful for the same order, so every
        setting that fixes the order (dataset length, num_replicas, seed,
        shuffle, drop_last, pad) must match; a mismatch raises ConfigError
        naming the saved and the current value. At an epoch boundary
        (position 0) the order is not yet used, so a change (e.g. resuming at
        another world size) is accepted and this sampler's settings win.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ConfigError(
                f"ShardedSampler.load_state_dict: state lacks {missing}; expected the keys "
                f"{list(_STATE_KEYS)} as written by ShardedSampler.state_dict()"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ConfigError(
                f"ShardedSampler.load_state_dict: epoch and position must be >= 0, "
                f"received epoch={epoch}, position={position}"
            )
        layers = [dict(layer) for layer in state.get("reshard") or []]
        if position > 0 or layers:
            here = self.state_dict()
            for key in ("dataset_len", "num_replicas", "seed", "shuffle", "drop_last", "pad"):
                if state[key] != here[key]:
                    hint = (
                        " At another world size, load the state through "
                        "scaletrain.checkpoint.load_checkpoint (or resume_state()), which "
                        "shares the epoch's remaining samples among the new ranks."
                        if key == "num_replicas"
                        else ""
                    )
                    raise ConfigError(
                        f"ShardedSampler.load_state_dict: saved {key}={state[key]!r} but this "
                        f"sampler has {key}={here[key]!r}; a mid-epoch position "
                        f"(position={position}) cannot be resumed with a different order.{hint}"
                    )
        self._epoch = epoch
        self._layers = layers
        self._cache = None
        # With pad=False shards differ by one, so a state saved on a longer shard
        # (e.g. rank 0's, shared by all ranks) may say one more than this rank
        # has; beyond len(self) means "this epoch is finished" either way.
        self._position = min(position, len(self))


def _split(order: torch.Tensor, replicas: int) -> list[torch.Tensor]:
    return [order[r::replicas] for r in range(replicas)]


def reshard(shards: Sequence[torch.Tensor], positions: Sequence[int]) -> torch.Tensor:
    """The indices no rank has reached, in the order the ranks would have taken them.

    `shards[r]` is rank r's indices for the epoch and `positions[r]` how many it
    consumed. Read column by column (every rank's next index, then every rank's one
    after), so the order stays the round-robin the epoch was dealt in; dealing it out
    again with `[r::new_world]` gives each new rank an even share.
    """
    rest = [s[int(p) :] for s, p in zip(shards, positions, strict=True)]
    longest = max((len(r) for r in rest), default=0)
    columns = [r[k] for k in range(longest) for r in rest if k < len(r)]
    return torch.stack(columns) if columns else torch.zeros(0, dtype=torch.long)


def resume_state(saved: Sequence[Mapping[str, Any]], world_size: int, rank: int) -> dict[str, Any]:
    """The state rank `rank` of `world_size` loads from the per-rank states `saved`.

    Same world size: that rank's own state. Another one, mid-epoch: the epoch goes on
    with the samples no saving rank had reached, dealt round-robin over the new ranks
    (each saved state's own reshard history is kept, so this repeats any number of
    times inside one epoch). Exact with pad=False: no sample is seen twice or skipped;
    drop_last drops fewer than `world_size` more of them and pad repeats some, as they
    do in any epoch.
    """
    if len(saved) == world_size:
        return dict(saved[rank])
    first = saved[0]
    epochs = {int(s["epoch"]) for s in saved}
    if len(epochs) != 1 or any(s.get("reshard") != first.get("reshard") for s in saved):
        raise ConfigError(
            "the saved loader states disagree on the epoch ("
            + ", ".join(f"rank {r}: epoch {s['epoch']}" for r, s in enumerate(saved))
            + "); every rank of a job saves the same epoch. The checkpoint's loader files "
            "were not written together."
        )
    layers = [dict(layer) for layer in first.get("reshard") or []]
    layers.append({"num_replicas": len(saved), "positions": [int(s["position"]) for s in saved]})
    return dict(first, num_replicas=world_size, position=0, reshard=layers)
