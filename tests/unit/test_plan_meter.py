"""plan/meter.py on the CPU: steps timed in CPU seconds, memory as the RSS's growth,
batches moved whole. (Its CUDA path: tests/gpu/test_plan_gpu.py.)"""

from __future__ import annotations

import torch

from scaletrain.plan.meter import Peak, in_turns, median_time, move


def _busy(n: int = 200_000) -> None:
    sum(i * i for i in range(n))


def test_cpu_steps_are_timed_in_cpu_seconds_and_in_turns() -> None:
    cpu, wall = median_time(_busy, 3)
    assert 0 < cpu <= wall * 1.5
    calls = {"a": 0, "b": 0}

    def a() -> None:
        calls["a"] += 1
        _busy()

    def b() -> None:
        calls["b"] += 1
        _busy(50_000)

    times = in_turns({"a": a, "b": b}, 3)
    assert calls == {"a": 5, "b": 5}  # two warm-up turns, three timed
    assert times["a"] > times["b"] > 0


def test_peak_sees_what_a_stretch_of_work_allocates() -> None:
    peak = Peak()
    if peak.start is None:  # no /proc here: nothing to restart
        assert peak.growth() is None
        return
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = peak.growth()
    del big
    assert grown is not None and grown >= 60 * 2**20


def test_move_keeps_the_batch_s_shape() -> None:
    x = {"a": torch.zeros(2), "b": [torch.ones(1), 3]}
    moved = move((x, torch.zeros(1)), torch.device("cpu"))
    assert isinstance(moved, tuple) and moved[0]["b"][1] == 3
    assert moved[0]["a"].device.type == "cpu"
    assert move(x, None) is x
