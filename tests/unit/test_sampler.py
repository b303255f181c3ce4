"""ShardedSampler and ShardedLoader: sharding, reshuffling, resuming. No process group."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.errors import ConfigError

SIZES = [0, 1, 2, 3, 4, 5, 7, 10, 11, 16, 17, 33]
WORLDS = [1, 2, 3, 4, 5]
MODES = [
    {"drop_last": False, "pad": True},
    {"drop_last": True, "pad": True},
    {"drop_last": False, "pad": False},
]


def shards(n: int, world: int, epoch: int = 0, **kw: object) -> list[list[int]]:
    out = []
    for r in range(world):
        s = ShardedSampler(n, num_replicas=world, rank=r, **kw)  # type: ignore[arg-type]
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(out[-1]) == len(s)
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mode", MODES, ids=["pad", "drop_last", "eval"])
def test_shards_are_disjoint_and_complete(mode: dict[str, bool], shuffle: bool) -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        parts = shards(n, world, shuffle=shuffle, seed=3, **mode)
        flat = [i for p in parts for i in p]
        counts = Counter(flat)
        assert all(0 <= i < n for i in flat)
        if mode["drop_last"]:
            # Each kept index exactly once; exactly n % world dropped.
            assert all(c == 1 for c in counts.values())
            assert len(flat) == n - n % world
            assert len({len(p) for p in parts}) == 1
        elif mode["pad"]:
            # Every index at least once, the padding repeats the order cyclically.
            assert set(flat) == set(range(n))
            assert len({len(p) for p in parts}) == 1
            assert len(flat) == (-(-n // world) * world if n else 0)
            if n:
                assert max(counts.values()) - min(counts.values()) <= 1
        else:
            # Evaluation: every sample exactly once overall, shards differ by <= 1.
            assert sorted(flat) == list(range(n)), (n, world)
            lens = [len(p) for p in parts]
            assert max(lens) - min(lens) <= 1


def test_padding_wraps_around_when_dataset_smaller_than_world() -> None:
    parts = shards(2, 5, shuffle=False)
    assert parts == [[0], [1], [0], [1], [0]]


@pytest.mark.parametrize("n", [1, 3, 10, 11, 17, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_matches_distributed_sampler(n: int, world: int, drop_last: bool, shuffle: bool) -> None:
    ds = TensorDataset(torch.arange(n))
    for rank, epoch in itertools.product(range(world), [0, 1, 5]):
        ref = DistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        ref.set_epoch(epoch)
        ours = ShardedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        ours.set_epoch(epoch)
        assert list(ours) == list(ref)
        assert len(ours) == len(ref)


def test_epochs_reshuffle_and_are_reproducible() -> None:
    a0, a1 = shards(100, 2, epoch=0)[0], shards(100, 2, epoch=1)[0]
    assert a0 != a1
    assert shards(100, 2, epoch=1)[0] == a1
    assert shards(100, 2, epoch=1, seed=1)[0] != a1
    assert shards(100, 2, epoch=1, shuffle=False)[0] == list(range(0, 100, 2))


@pytest.mark.parametrize("mode", MODES, ids=["pad", "drop_last", "eval"])
def test_resume_mid_epoch_equals_uninterrupted(mode: dict[str, bool]) -> None:
    for world, rank, k in [(1, 0, 3), (3, 2, 5), (4, 1, 0), (2, 0, 12)]:
        ref = ShardedSampler(53, num_replicas=world, rank=rank, seed=11, **mode)
        ref.set_epoch(4)
        full = list(ref)

        first = ShardedSampler(53, num_replicas=world, rank=rank, seed=11, **mode)
        first.set_epoch(4)
        it = iter(first)
        consumed = [next(it) for _ in range(min(k, len(first)))]
        first.advance(len(consumed))
        state = first.state_dict()

        second = ShardedSampler(53, num_replicas=world, rank=rank, seed=11, **mode)
        second.load_state_dict(state)
        second.set_epoch(4)  # the usual loop re-sets the same epoch: must keep position
        assert second.epoch == 4 and second.position == len(consumed)
        assert consumed + list(second) == full
        assert second.remaining() == len(full) - len(consumed)


def test_position_survives_exhaustion_until_next_epoch() -> None:
    s = ShardedSampler(10, num_replicas=2, rank=0)
    s.advance(len(list(s)))
    assert s.position == len(s) and list(s) == []
    assert s.state_dict()["position"] == 5
    s.set_epoch(0)  # same epoch: still done
    assert list(s) == []
    s.set_epoch(1)
    assert s.position == 0 and len(list(s)) == 5


def test_load_state_mismatch_mid_epoch_is_refused() -> None:
    s = ShardedSampler(100, num_replicas=4, rank=0, seed=1)
    s.advance(3)
    state = s.state_dict()
    with pytest.raises(
        ConfigError, match=r"saved num_replicas=4 but this sampler has num_replicas=2"
    ):
        ShardedSampler(100, num_replicas=2, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(
        ConfigError, match=r"saved dataset_len=100 but this sampler has dataset_len=90"
    ):
        ShardedSampler(90, num_replicas=4, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"saved seed=1 .* seed=2"):
        ShardedSampler(100, num_replicas=4, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="lacks"):
        ShardedSampler(100, num_replicas=4, rank=0).load_state_dict({"epoch": 1})


def test_load_state_other_world_size_at_epoch_boundary_is_fine() -> None:
    s = ShardedSampler(100, num_replicas=4, rank=0, seed=1)
    s.set_epoch(3)
    other = ShardedSampler(100, num_replicas=2, rank=1, seed=1)
    other.load_state_dict(s.state_dict())
    assert other.epoch == 3 and other.position == 0 and other.num_replicas == 2
    ref = ShardedSampler(100, num_replicas=2, rank=1, seed=1)
    ref.set_epoch(3)
    assert list(other) == list(ref)


def test_eval_state_from_a_longer_shard_means_done() -> None:
    # pad=False: rank 0 holds one more index than rank 2; a state shared from
    # rank 0 at the end of the epoch means "finished" on rank 2 too.
    r0 = ShardedSampler(10, num_replicas=3, rank=0, pad=False)
    r0.advance(len(r0))
    r2 = ShardedSampler(10, num_replicas=3, rank=2, pad=False)
    r2.load_state_dict(r0.state_dict())
    assert r2.position == len(r2) == 3 and list(r2) == []


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"num_replicas": 0, "rank": 0}, r"num_replicas must be an int >= 1, received 0"),
        ({"num_replicas": 2, "rank": 2}, r"rank must be an int in \[0, 1\].*received 2"),
        ({"num_replicas": 2, "rank": -1}, r"received -1"),
    ],
)
def test_bad_arguments(kw: dict[str, int], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        ShardedSampler(10, **kw)


def test_advance_beyond_epoch_is_refused() -> None:
    s = ShardedSampler(10, num_replicas=2, rank=0)
    s.advance(4)
    with pytest.raises(ConfigError, match=r"position would become 6, expected 0 <= position <= 5"):
        s.advance(2)
    with pytest.raises(ConfigError):
        s.advance(-1)


# -- loader -------------------------------------------------------------------


def make_loader(n: int = 23, batch: int = 4, **kw: object) -> ShardedLoader:
    ds = TensorDataset(torch.arange(n))
    sampler = ShardedSampler(ds, num_replicas=2, rank=1, seed=5)
    return ShardedLoader(ds, batch_size=batch, sampler=sampler, **kw)  # type: ignore[arg-type]


def epoch_order(loader: ShardedLoader) -> list[int]:
    return [int(i) for (b,) in loader for i in b]


def test_loader_auto_advances_epochs() -> None:
    loader = make_loader()
    assert len(loader) == 3  # 12 indices on rank 1, batch 4
    e0 = epoch_order(loader)
    assert loader.epoch == 1 and loader.sampler.position == 0
    e1 = epoch_order(loader)
    assert loader.epoch == 2
    assert e0 != e1 and sorted(set(e0)) != []
    ref = ShardedSampler(23, num_replicas=2, rank=1, seed=5)
    assert e0 == list(ref)
    ref.set_epoch(1)
    assert e1 == list(ref)
    # A user loop that calls set_epoch itself sees the same orders.
    loader2 = make_loader()
    orders = []
    for epoch in range(2):
        loader2.set_epoch(epoch)
        orders.append(epoch_order(loader2))
    assert orders == [e0, e1]


def test_loader_abandoned_pass_does_not_advance_epoch() -> None:
    loader = make_loader()
    for _ in loader:
        break
    assert loader.epoch == 0 and loader.sampler.position == 4


def test_loader_stopped_at_its_last_batch_starts_the_next_epoch() -> None:
    """`for i, b in enumerate(loader): ... if i == last: break` must not give an empty epoch."""
    loader = make_loader()
    e0 = []
    for i, (b,) in enumerate(loader):
        e0 += [int(j) for j in b]
        if i == len(loader) - 1:
            break
    assert loader.epoch == 0 and loader.remaining() == 0
    e1 = epoch_order(loader)
    assert len(e1) == len(e0) and e1 != e0
    ref = ShardedSampler(23, num_replicas=2, rank=1, seed=5)
    ref.set_epoch(1)
    assert e1 == list(ref)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_resume_mid_epoch(num_workers: int, drop_last: bool) -> None:
    ref = make_loader(n=41, batch=3, drop_last=drop_last)
    ref.set_epoch(2)
    full = [b[0].tolist() for b in ref]
    assert len(full) == len(make_loader(n=41, batch=3, drop_last=drop_last))

    first = make_loader(n=41, batch=3, drop_last=drop_last, num_workers=num_workers)
    first.set_epoch(2)
    seen = []
    for i, (b,) in enumerate(first):
        seen.append(b.tolist())
        if i == 2:
            # Workers have prefetched further, but the state counts handed-out batches.
            state = first.state_dict()
            break
    assert state["position"] == 9 and state["epoch"] == 2

    second = make_loader(n=41, batch=3, drop_last=drop_last, num_workers=num_workers)
    second.load_state_dict(state)
    assert second.remaining() == len(full) - 3
    rest = [b[0].tolist() for b in second]
    assert seen + rest == full
    assert second.epoch == 3


class _RandomPerSample(torch.utils.data.Dataset[int]):
    """Returns a draw from the worker's RNG: shows how workers were seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return int(torch.randint(0, 2**30, ()))


def test_loader_worker_seeds_follow_seed_rank_epoch() -> None:
    def draws(rank: int, epoch: int) -> list[int]:
        ds = _RandomPerSample()
        sampler = ShardedSampler(ds, num_replicas=2, rank=rank, seed=3)
        loader = ShardedLoader(ds, batch_size=2, sampler=sampler, num_workers=1)
        loader.set_epoch(epoch)
        return [int(v) for b in loader for v in b]

    assert draws(0, 0) == draws(0, 0)  # reproducible, e.g. after a resume
    assert draws(0, 0) != draws(1, 0)  # ranks augment differently
    assert draws(0, 0) != draws(0, 1)  # so do epochs


def test_loader_rejects_mismatched_dataset() -> None:
    with pytest.raises(ConfigError, match="dataset has 5 samples but the sampler was built for 6"):
        ShardedLoader(
            TensorDataset(torch.arange(5)),
            batch_size=2,
            sampler=ShardedSampler(6, num_replicas=1, rank=0),
        )
    with pytest.raises(ConfigError, match="batch_size"):
        make_loader(batch=0)


def test_a_loader_tells_which_rows_it_handed_out_were_padding() -> None:
    """7 samples on rank 1 of 3: positions 1, 4, 7 of the padded order; 7 repeats one."""
    sampler = ShardedSampler(7, num_replicas=3, rank=1, shuffle=False)
    assert sampler.padding().tolist() == [False, False, True]
    loader = ShardedLoader(list(range(7)), batch_size=2, sampler=sampler)
    batches = iter(loader)
    assert next(batches).tolist() == [1, 4]
    assert loader.padding(2).tolist() == [False, False]
    assert next(batches).tolist() == [0]  # the repeat of sample 0
    assert loader.padding(1).tolist() == [True]  # the last batch's
    assert loader.padding(3).tolist() == [False, False, True]  # the pass's
    with pytest.raises(ConfigError, match=r"received 4 rows, but the loader's last batch had 1"):
        loader.padding(4)
    assert list(batches) == []  # the pass is over: its rows are still known
    assert loader.padding(3).tolist() == [False, False, True]
    # No padding: drop_last, pad=False, or shards that divide.
    for kwargs in ({"drop_last": True}, {"pad": False}):
        assert not ShardedSampler(7, num_replicas=3, rank=1, **kwargs).padding().any()
    assert not ShardedSampler(6, num_replicas=3, rank=2).padding().any()
