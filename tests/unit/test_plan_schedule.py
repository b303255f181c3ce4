"""A pipeline's step simulated: PyTorch's schedules' orders, their textbook times, shared cores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.plan.layertime import LOSS, layer_shares
from scaletrain.plan.schedule import actions, simulate
from scaletrain.strategies.partition import list_layers


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 4), (4, 8), (3, 6), (4, 2)])
def test_equal_stages_on_devices_of_their_own_take_the_textbook_time(
    schedule: str, pp: int, m: int
) -> None:
    # (M + pp - 1) slots of a stage's forward and backward: the bubble is (pp-1)/M.
    t = simulate([1.0] * pp, [2.0] * pp, schedule=schedule, microbatches=m)
    assert t.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert t.work == pytest.approx([m * 3.0] * pp)
    # The first stage ends last: it works m x 3 and waits for the others the rest.
    assert t.running[0] + t.idle[0] == pytest.approx(t.makespan)


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


def test_stages_take_turns_for_the_cores() -> None:
    # GPipe, 2 stages, 2 microbatches, every action 1 s. One core: it is never idle
    # while a stage has work, so the step is all of the work, 8 s; two cores: the
    # pipeline's own 3 slots of 2 s.
    one = simulate([1.0] * 2, [1.0] * 2, schedule="gpipe", microbatches=2, cores=1)
    assert one.makespan == pytest.approx(8.0)
    two = simulate([1.0] * 2, [1.0] * 2, schedule="gpipe", microbatches=2, cores=2)
    assert two.makespan == pytest.approx(6.0)
    assert simulate([1.0] * 2, [1.0] * 2, schedule="gpipe", microbatches=2).makespan == 6.0
    # Replicas (ddp x pp) and other programs' threads take their share of the cores:
    # one microbatch runs its 4 actions one after another, each at 2 / ranks-at-work.
    chain = {"schedule": "gpipe", "microbatches": 1, "cores": 2}
    assert simulate([1.0] * 2, [1.0] * 2, replicas=2, **chain).makespan == pytest.approx(4.0)  # type: ignore[arg-type]
    assert simulate([1.0] * 2, [1.0] * 2, replicas=4, **chain).makespan == pytest.approx(8.0)  # type: ignore[arg-type]
    busy = simulate([1.0] * 2, [1.0] * 2, background=2, **chain)  # type: ignore[arg-type]
    assert busy.makespan == pytest.approx(6.0)
    assert busy.running[0] == pytest.approx(3.0) and busy.work[0] == pytest.approx(2.0)


def test_sends_delay_the_stage_that_waits_for_them() -> None:
    # One microbatch over 2 stages: forward, send, forward, backward, send, backward.
    t = simulate([1.0] * 2, [2.0] * 2, schedule="1f1b", microbatches=1, hop=0.5)
    assert t.makespan == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 0.5)


def test_the_optimizer_runs_after_the_schedule() -> None:
    t = simulate([1.0] * 2, [2.0] * 2, schedule="1f1b", microbatches=2, tail=[0.5, 4.0])
    # Stage 1 ends its last backward at 7 s (stage 0's at 9 s), then its 4 s tail.
    assert t.makespan == pytest.approx(11.0)
    assert t.work == pytest.approx([6.5, 10.0])


def test_a_stage_count_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="pp x virtual"):
        simulate([1.0] * 3, [1.0] * 3, schedule="interleaved-1f1b", microbatches=2, virtual=2)


class _Heavy(nn.Module):
    """Parameter-free, and costs time no FLOP counter sees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = torch.tanh(x) * 1.0001
        return x


def test_each_layers_share_is_timed_on_the_model_itself() -> None:
    torch.manual_seed(0)
    # A cheap first layer (few FLOPs) with a heavy parameter-free part joining it, and
    # a wide Linear: time, not FLOPs, decides which stage is the busy one.
    model = nn.Sequential(
        nn.Linear(16, 256), _Heavy(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 4)
    )
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    layers = list_layers(model)
    shares = layer_shares(model, (x, y), nn.functional.cross_entropy, layers, repeats=3)
    assert shares is not None
    assert set(shares) == {"0", "2", "4", LOSS}
    assert sum(f + b for f, b in shares.values()) == pytest.approx(1.0)
    # _Heavy (a member of layer "0") runs 20 elementwise passes: layer 0 outweighs the
    # last Linear, though it holds a fraction of the FLOPs.
    assert sum(shares["0"]) > sum(shares["4"])


def test_a_layer_that_cannot_run_alone_leaves_flops_to_decide() -> None:
    class Needy(nn.Linear):
        ready = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.ready:
                raise RuntimeError("called outside its model")
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = Needy(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.b.ready = True
            try:
                return self.b(self.a(x))
            finally:
                self.b.ready = False

    model = Model()
    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    assert layer_shares(model, batch, nn.functional.cross_entropy, list_layers(model)) is None


def test_a_module_called_twice_counts_twice() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.act = _Heavy()  # parameter-free: joins layer "a"
            self.b = nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.act(self.a(x))))

    class Once(Twice):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.a(x)))

    batch = (torch.randn(64, 64), torch.randint(0, 4, (64,)))
    twice = layer_shares(Twice(), batch, nn.functional.cross_entropy, list_layers(Twice()))
    once = layer_shares(Once(), batch, nn.functional.cross_entropy, list_layers(Once()))
    assert twice is not None and once is not None
    # The heavy activation runs twice: its layer holds more of the step.
    assert sum(twice["a"]) > sum(once["a"])
