"""A pipeline's step simulated: PyTorch's schedules' orders and their textbook times."""

from __future__ import annotations

import pytest

from scaletrain.planner.schedule import actions, simulate


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 4), (4, 8), (3, 6), (4, 2)])
def test_equal_stages_on_devices_of_their_own_take_the_textbook_time(
    schedule: str, pp: int, m: int
) -> None:
    # (M + pp - 1) slots of a stage's forward and backward: the bubble is (pp-1)/M.
    t = simulate([1.0] * pp, [2.0] * pp, schedule=schedule, microbatches=m)
    assert t.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert t.work == pytest.approx([m * 3.0] * pp)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 2), (2, 4, 3), (4, 12, 3)])
def test_interleaving_divides_the_bubble_by_the_chunks_per_rank(pp: int, m: int, v: int) -> None:
    # Each rank holds v chunks of 1/v of a stage's work: the bubble is (pp-1)/(v M).
    t = simulate(
        [1.0 / v] * (pp * v), [2.0 / v] * (pp * v), schedule="interleaved-1f1b",
        microbatches=m, virtual=v,
    )  # fmt: skip
    assert t.makespan == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)


def test_1f1b_warms_up_as_torchs_schedule1f1b_does() -> None:
    # Schedule1F1B: the first stage runs pp forwards before its first backward, the
    # last one; then a backward and a forward in turn.
    assert actions("1f1b", 0, 4, 4) == [("F", 0, i) for i in range(4)] + [
        ("B", 0, i) for i in range(4)
    ]
    assert actions("1f1b", 3, 4, 4) == [
        ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1),
        ("F", 3, 2), ("B", 3, 2), ("F", 3, 3), ("B", 3, 3),
    ]  # fmt: skip
    assert actions("1f1b", 1, 2, 4) == [
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1),
        ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
    ]  # fmt: skip
    assert actions("gpipe", 1, 2, 2) == [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]
    with pytest.raises(ValueError, match="expected one of 1f1b, gpipe, interleaved-1f1b"):
        actions("zb", 0, 2, 2)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 2), (3, 6, 2)])
def test_interleaved_order_is_torchs(pp: int, m: int, v: int) -> None:
    # The order torch's ScheduleInterleaved1F1B computes per rank (its padding slots
    # dropped), from its own method on a stand-in holding only what the method reads.
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, m // pp)
    stand_in = SimpleNamespace(
        n_local_stages=v, pp_group_size=pp, _n_microbatches=m, microbatches_per_round=m // rounds
    )
    for rank in range(pp):
        theirs = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(stand_in, rank)
        expected = [
            ("F" if a.computation_type == schedules._ComputationType.FORWARD else "B",
             a.stage_index, a.microbatch_index)
            for a in theirs
            if a is not None
        ]  # fmt: skip
        assert actions("interleaved-1f1b", rank, pp, m, v) == expected


def test_an_interleaved_schedule_torch_refuses_is_refused() -> None:
    # torch's Interleaved 1F1B runs microbatches in rounds of pp, which must divide them.
    with pytest.raises(ValueError, match="divisible by the number of rounds"):
        actions("interleaved-1f1b", 0, 3, 16, 2)


def test_sends_delay_the_stage_that_waits_for_them() -> None:
    # One microbatch over 2 stages: forward, send, forward, backward, send, backward.
    t = simulate([1.0] * 2, [2.0] * 2, schedule="1f1b", microbatches=1, hop=0.5)
    assert t.makespan == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 0.5)


def test_each_rank_works_its_own_actions() -> None:
    t = simulate([1.0] * 2, [2.0] * 2, schedule="1f1b", microbatches=2)
    # Stage 1 ends its last backward at 7 s, stage 0 at 9 s (its backward waits for 1's).
    assert t.makespan == pytest.approx(9.0)
    assert t.work == pytest.approx([6.0, 6.0])


def test_a_stage_count_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="pp x virtual"):
        simulate([1.0] * 3, [1.0] * 3, schedule="interleaved-1f1b", microbatches=2, virtual=2)
