"""An epoch interrupted at one world size goes on at another, exactly (issue 8, points 5 and 9).

Every case plays a whole epoch: R old ranks consume some of their shard, save their
states; R' new ranks load what `resume_state` makes of them and consume the rest.
With pad=False no sample may be seen twice or skipped; drop_last may drop fewer than
R' more; pad may repeat some (as in any epoch), but skips none.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from scaletrain.data import ShardedLoader, ShardedSampler
from scaletrain.errors import ConfigError


def resume_state(saved: list[dict[str, object]], world_size: int, rank: int) -> dict[str, object]:
    # Imported here so that the other tests of this file run against code without it.
    from scaletrain.data.sampler import resume_state as made

    return made(saved, world_size, rank)


MODES = {
    "exact": {"pad": False},
    "drop_last": {"drop_last": True},
    "pad": {},
}


def _play(
    n: int, worlds: list[int], mode: dict[str, bool], seed: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """Consume one epoch through the world sizes in `worlds`, stopping at random positions.

    Returns (every index consumed, the epoch's indices at the first world size).
    """
    samplers = [
        ShardedSampler(n, num_replicas=worlds[0], rank=r, seed=seed, **mode)
        for r in range(worlds[0])
    ]
    whole = [i for s in samplers for i in s.indices().tolist()]
    seen: list[int] = []
    for after in [*worlds[1:], None]:
        for s in samplers:
            take = len(s) if after is None else rng.randint(0, len(s))
            seen += s.indices()[s.position : s.position + take].tolist()
            s.advance(take)
        if after is None:
            break
        saved = [s.state_dict() for s in samplers]
        samplers = [
            ShardedSampler(n, num_replicas=after, rank=r, seed=seed, **mode) for r in range(after)
        ]
        for r, s in enumerate(samplers):
            s.load_state_dict(resume_state(saved, after, r))
    return seen, whole


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("worlds", [[2, 3], [3, 2], [2, 3, 2], [3, 1], [1, 4], [4, 3, 2, 5]])
def test_resharded_epoch_sees_every_sample_once(mode: str, worlds: list[int]) -> None:
    rng = random.Random(f"{mode}{worlds}")
    for n, seed in itertools.product([0, 1, 2, 5, 17, 100, 1003], [0, 7]):
        seen, whole = _play(n, worlds, MODES[mode], seed, rng)
        counts = Counter(seen)
        if mode == "exact":
            assert sorted(seen) == list(range(n)), (n, seed)
        elif mode == "drop_last":
            assert max(counts.values(), default=1) == 1, (n, seed)
            # Each reshard drops fewer than the new world size, as an epoch's tail does.
            dropped = len(set(whole)) - len(counts)
            assert 0 <= dropped < sum(worlds[1:]), (n, seed, dropped)
            assert set(counts) <= set(whole)
        else:
            assert set(counts) == set(range(n)), (n, seed)


def test_resharded_ranks_share_the_rest_evenly_in_dealing_order() -> None:
    old = [ShardedSampler(20, num_replicas=2, rank=r, seed=3, pad=False) for r in range(2)]
    for s in old:
        s.advance(4)
    left = [s.indices()[4:].tolist() for s in old]
    saved = [s.state_dict() for s in old]
    new = [ShardedSampler(20, num_replicas=3, rank=r, seed=3, pad=False) for r in range(3)]
    for r, s in enumerate(new):
        s.load_state_dict(resume_state(saved, 3, r))
    # Round-robin over the old ranks' next samples, dealt round-robin to the new ones.
    dealt = [x for pair in zip(*left, strict=True) for x in pair]
    assert [list(s) for s in new] == [dealt[r::3] for r in range(3)]
    assert [len(s) for s in new] == [4, 4, 4]
    # The next epoch is an ordinary one at the new world size.
    for s in new:
        s.set_epoch(1)
        fresh = ShardedSampler(20, num_replicas=3, rank=s.rank, seed=3, pad=False)
        assert torch.equal(s.indices(), fresh.indices(1))


def test_a_resharded_state_round_trips_and_resumes_mid_way() -> None:
    old = [ShardedSampler(30, num_replicas=3, rank=r, seed=1) for r in range(3)]
    for s in old:
        s.advance(3)
    saved = [s.state_dict() for s in old]
    a = ShardedSampler(30, num_replicas=2, rank=1, seed=1)
    a.load_state_dict(resume_state(saved, 2, 1))
    a.advance(2)
    b = ShardedSampler(30, num_replicas=2, rank=1, seed=1)
    b.load_state_dict(a.state_dict())
    assert list(b) == list(a) and len(b) == len(a) == 11


def test_saved_states_of_different_epochs_are_refused() -> None:
    saved = [ShardedSampler(10, num_replicas=2, rank=r).state_dict() for r in range(2)]
    saved[1]["epoch"] = 1
    with pytest.raises(ConfigError, match="disagree on the epoch"):
        resume_state(saved, 3, 0)


def test_uneven_shards_agree_on_the_epoch_after_a_restore() -> None:
    """Point 9: pad=False, 1003 samples, batch 167, 3 ranks: shards 335/334/334, so rank 0
    has 3 batches and ranks 1-2 two. Restored after two batches, every rank must finish
    epoch 0 (rank 0 its last batch, the others nothing) before any starts epoch 1."""
    data = torch.utils.data.TensorDataset(torch.arange(1003))

    def loader(rank: int) -> ShardedLoader:
        sampler = ShardedSampler(1003, num_replicas=3, rank=rank, shuffle=False, pad=False)
        return ShardedLoader(data, batch_size=167, sampler=sampler)

    states = []
    for rank in range(3):
        first = loader(rank)
        batches = iter(first)
        next(batches), next(batches)
        states.append(first.state_dict())
    passes = []
    for rank in range(3):
        again = loader(rank)
        again.load_state_dict(states[rank])
        after_restore = [b[0] for b in again]
        next_pass = [b[0] for b in again]
        passes.append((len(after_restore), again.epoch, len(next_pass)))
        expected = again.sampler.indices(1).tolist()
        assert torch.cat(next_pass).tolist() == expected
    # Rank 0's last batch of epoch 0, nothing for the others; then all of epoch 1.
    assert [p[0] for p in passes] == [1, 0, 0]
    assert [p[2] for p in passes] == [3, 2, 2]
    assert {p[1] for p in passes} == {2}


@pytest.mark.parametrize("worlds", [[1], [2], [3], [2, 3], [3, 2], [4, 3, 2, 5], [3, 1], [1, 4]])
def test_padding_marks_every_repeat_also_across_reshards(worlds: list[int]) -> None:
    """pad=True repeats samples so that every rank has as many; `padding()` says which of
    a rank's indices are those repeats (rt.gather_for_metrics drops them): without them
    the epoch holds every sample exactly once, whatever world sizes it went through."""
    rng = random.Random(str(worlds))
    for n, seed in itertools.product([0, 1, 2, 5, 17, 100], [0, 7]):
        samplers = [
            ShardedSampler(n, num_replicas=worlds[0], rank=r, seed=seed) for r in range(worlds[0])
        ]
        real: list[int] = []
        for after in [*worlds[1:], None]:
            for s in samplers:
                take = len(s) if after is None else rng.randint(0, len(s))
                window = slice(s.position, s.position + take)
                real += s.indices()[window][~s.padding()[window]].tolist()
                s.advance(take)
            if after is None:
                break
            saved = [s.state_dict() for s in samplers]
            samplers = [
                ShardedSampler(n, num_replicas=after, rank=r, seed=seed) for r in range(after)
            ]
            for r, s in enumerate(samplers):
                s.load_state_dict(resume_state(saved, after, r))
        assert sorted(real) == list(range(n)), (n, seed)
