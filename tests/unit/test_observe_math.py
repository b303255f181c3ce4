"""Stragglers on synthetic windows, HTA's overlap on hand-built intervals, MFU and peaks."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable

import pytest

from scaletrain.hardware import datasheet_peak
from scaletrain.observe.metrics.flops import compute_mfu, measure_peak
from scaletrain.observe.metrics.overlap import intersection_length, overlap_stats, union
from scaletrain.observe.metrics.phases import COMM, DATA, FORWARD, PHASES
from scaletrain.observe.metrics.stragglers import StragglerDetector
from scaletrain.observe.metrics.window import RankWindow, WindowStats


def _window(rank: int, forward: float = 10e-3, data: float = 1e-3, comm: float = 2e-3,
            noise: float = 0.0, rng: random.Random | None = None) -> RankWindow:  # fmt: skip
    jitter = (lambda: 1 + rng.gauss(0, noise)) if rng else (lambda: 1.0)
    phases = [0.0] * len(PHASES)
    phases[DATA] = data * jitter()
    phases[FORWARD] = forward * jitter()
    phases[PHASES.index("backward")] = 2 * 10e-3 * jitter()
    phases[COMM] = comm
    return RankWindow(rank=rank, peer_group=0, steps=10, wall=sum(phases), phases=phases)


def _run(windows: list[list[RankWindow]]) -> tuple[StragglerDetector, list[int]]:
    detector = StragglerDetector()
    named_at = []
    for i, ranks in enumerate(windows):
        if detector.update(WindowStats.build(i * 10 + 1, i * 10 + 10, ranks)):
            named_at.append(i)
    return detector, named_at


def test_a_rank_20_percent_slower_in_forward_is_named_after_two_windows() -> None:
    rng = random.Random(0)
    windows = []
    for _ in range(4):
        # forward is 20 of the ~43 ms step: 20% slower costs ~9% of the step.
        ranks = [_window(r, forward=20e-3, noise=0.02, rng=rng) for r in range(4)]
        slow = ranks[2]
        slow.phases[FORWARD] *= 1.2
        slow.wall = sum(slow.phases)
        # Its peers wait for it in the all-reduce (DeepSpeed's measure of the cost).
        for r in ranks:
            if r.rank != 2:
                r.phases[COMM] += 4e-3
        windows.append(ranks)
    detector, named_at = _run(windows)
    assert named_at == [1]  # patience: two windows in a row
    s = detector.named[2]
    assert s.phase == "forward" and 0.78 < s.score < 0.9
    assert s.cost_s == pytest.approx(4e-3)
    assert "rank 2" in s.describe() and "forward" in s.describe()


def test_a_slow_loader_is_named_with_data() -> None:
    windows = []
    for _ in range(2):
        ranks = [_window(r) for r in range(2)]
        ranks[1].phases[DATA] = 8e-3
        ranks[0].phases[COMM] += 7e-3  # rank 0 waits for it in the all-reduce
        windows.append(ranks)
    detector, _ = _run(windows)
    assert detector.named[1].phase == "data"


def test_balanced_noisy_ranks_raise_no_alarm() -> None:
    rng = random.Random(1)
    # 3% noise on every phase's window median, independently per rank (medians of 10+
    # steps on a loaded 2-core box move less), 200 windows of 4 ranks.
    windows = [[_window(r, noise=0.03, rng=rng) for r in range(4)] for _ in range(200)]
    detector, _ = _run(windows)
    assert detector.named == {}


def test_a_tiny_phase_twice_as_slow_costs_nothing_and_names_nobody() -> None:
    windows = []
    for _ in range(3):
        ranks = [_window(r, data=0.1e-3) for r in range(2)]
        ranks[1].phases[DATA] = 0.2e-3  # 2x slower, 0.3% of the step
        windows.append(ranks)
    detector, _ = _run(windows)
    assert detector.named == {}


def test_pipeline_stages_are_not_compared_with_each_other() -> None:
    windows = []
    for _ in range(3):
        a, b = _window(0), _window(1, forward=30e-3)  # the heavier stage
        b.peer_group = 1
        windows.append([a, b])
    detector, _ = _run(windows)
    assert detector.named == {}


def test_overlap_follows_hta_definitions_on_hand_built_intervals() -> None:
    # compute [0,10] and [20,30]; comm [5,25]: 5+5 of 20 overlapped.
    stats = overlap_stats(comm=[(5, 25)], compute=[(0, 10), (20, 30)])
    assert stats.comm_s == 20 and stats.overlapped_s == 10 and stats.exposed_s == 10
    assert stats.overlap == pytest.approx(0.5)
    # Nested and overlapping compute spans count once; comm fully inside: 100%.
    assert overlap_stats([(2, 3)], [(0, 5), (1, 4), (4, 6)]).overlap == 1.0
    # Nothing overlaps: all exposed.
    assert overlap_stats([(10, 12)], [(0, 5)]).exposed_s == 2
    assert overlap_stats([], [(0, 1)]).overlap is None
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert intersection_length([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)


def test_datasheet_peaks_are_dense_and_never_another_devices() -> None:
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert datasheet_peak("NVIDIA H100 NVL", "bf16") == pytest.approx(835.5e12)
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert datasheet_peak("NVIDIA H200", "fp32") == pytest.approx(67e12)
    assert datasheet_peak("NVIDIA L40S", "bf16") == pytest.approx(362.05e12)
    assert datasheet_peak("NVIDIA L4", "bf16") == pytest.approx(121e12)
    # Unknown devices and dtypes a device lacks: no figure at all (torchtitan's A100
    # fallback is how 563% MFU happens).
    assert datasheet_peak("NVIDIA GeForce RTX 9090", "bf16") is None
    assert datasheet_peak("Tesla V100-SXM2-16GB", "bf16") is None
    assert datasheet_peak("Tesla T4", "fp16") == pytest.approx(65e12)


def test_mfu_over_100_percent_is_a_measurement_error() -> None:
    ok = compute_mfu(1e12, 1.0, peak_measured=4e12, peak_datasheet=8e12)
    assert ok.mfu_measured == pytest.approx(0.25) and ok.mfu_datasheet == pytest.approx(0.125)
    assert ok.error is None
    bad = compute_mfu(1e12, 0.1, peak_measured=4e12, peak_datasheet=None)
    assert bad.mfu_datasheet is None
    assert bad.error is not None and "measurement error" in bad.error and "250%" in bad.error


def test_measured_peak_is_cached(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path))
    first = measure_peak("cpu", "fp32", device_name="cpu (test)", seconds=0.05)
    assert first > 1e8  # any CPU does more than 0.1 GFLOP/s
    # The second call reads the cache: the same number, no benchmark.
    assert measure_peak("cpu", "fp32", device_name="cpu (test)", seconds=5) == first


def _summary(ranks: list[tuple[int, float, float, float]], overlap: float | None = None) -> dict:
    """A summary.json's fields advice reads: per rank (peer group, forward, backward,
    comm) seconds per step; the phases' medians over the ranks."""
    import statistics

    rows = []
    for group, fwd, bwd, comm in ranks:
        phases = dict.fromkeys(PHASES, 0.0) | {"forward": fwd, "backward": bwd, "comm": comm}
        rows.append(
            {"peer_group": group, "phases": phases, "overlap": overlap, "step": fwd + bwd + comm}
        )
    med = {p: statistics.median(r["phases"][p] for r in rows) for p in PHASES}
    med["step"] = statistics.median(r["step"] for r in rows)
    return {"stragglers": [], "ranks": rows, "phases": {k: {"median": v} for k, v in med.items()}}


def test_advice_names_a_pipelines_waiting_not_the_gradient_all_reduce() -> None:
    """A pipeline stage's comm is its waiting for the other stages: the advice says
    so, and which knob helps (uneven stages, else more microbatches)."""
    from scaletrain.observe.metrics.summary import advice

    ddp = advice(_summary([(0, 0.01, 0.02, 0.02), (0, 0.01, 0.02, 0.02)], overlap=0.3))
    assert ddp is not None and ddp.startswith("Communication-bound: 40%") and "all-reduce" in ddp
    uneven = advice(_summary([(0, 0.03, 0.03, 0.01), (1, 0.002, 0.002, 0.06)]))
    assert uneven is not None and uneven.startswith("Pipeline-bound: stages wait")
    assert "all-reduce" not in uneven
    assert "pipeline rank 0 computes 60.0 ms per step, pipeline rank 1 4.0 ms" in uneven
    assert "Pipeline(stages=[...])" in uneven
    even = advice(_summary([(0, 0.02, 0.02, 0.03), (1, 0.02, 0.02, 0.03)]))
    assert (
        even is not None
        and even.startswith("Pipeline-bound")
        and "Pipeline(microbatches=...)" in even
    )


def _crowded(cpu_waits: list[float], slow: int = 1) -> list[list[RankWindow]]:
    """Two windows of 3 ranks where rank `slow`'s forward and backward are 1.3x its
    peers' (9 ms per step more; its peers wait for it in the all-reduce); `cpu_waits`:
    each rank's run-queue wait per step (NaN: not known)."""
    windows = []
    for _ in range(2):
        ranks = [_window(r) for r in range(3)]
        w = ranks[slow]
        w.phases[FORWARD] *= 1.3
        w.phases[PHASES.index("backward")] *= 1.3
        w.wall = sum(w.phases)
        for r in ranks:
            r.cpu_wait = cpu_waits[r.rank]
            if r.rank != slow:
                r.phases[COMM] += 8e-3
        windows.append(ranks)
    return windows


def test_a_rank_slow_because_it_waited_for_a_cpu_is_named_with_its_wait() -> None:
    """A rank 9 ms/step slower than its peers that waited 12 ms/step for a CPU is slow
    because its host ran other processes on its core: the warning, the summary line and
    the advice say that, not "slow in backward" (2 ranks on 2 cores named one "slow in
    forward 1.27-1.33x" in 2 of 6 balanced runs). So when its peers waited as long
    (a crowded host: whichever rank the kernel runs last in a phase looks slow there)."""
    from scaletrain.observe.metrics.summary import _lines, advice

    for waits, peers in (([0.3e-3, 12.3e-3, 0.2e-3], 0.25e-3), ([11e-3, 12.3e-3, 12e-3], 11.5e-3)):
        detector, named_at = _run(_crowded(waits))
        assert named_at == [1]
        s = detector.named[1]
        assert s.waited_for_cpu
        assert s.cpu_wait_s == pytest.approx(12.3e-3)
        assert s.peer_cpu_wait_s == pytest.approx(peers)
        text = s.describe("node07")
        assert text.startswith(
            "straggler: rank 1 (node07) waited 12.3 ms/step for a CPU (other processes on "
            f"its host; its peers {peers * 1e3:.1f} ms) over steps 11-20"
        )
        assert "slow in" not in text and "Not its device" in text
        summary = {"stragglers": [s.as_dict()], "ranks": [], "phases": {}}
        line = advice(summary)
        assert line is not None
        assert "rank 1 waited 12.3 ms/step for a CPU (other processes on its host)" in line
        assert "device and node" not in line
        [listed] = _lines(summary)
        assert listed.startswith("straggler: rank 1 waited 12.3 ms/step for a CPU")
    # Only its own wait known: the claim stands on it, no peers' figure.
    detector, _ = _run(_crowded([math.nan, 12.3e-3, math.nan]))
    s = detector.named[1]
    assert s.waited_for_cpu and s.peer_cpu_wait_s is None
    assert "(other processes on its host) over steps" in s.describe()


def test_a_rank_slow_on_its_own_keeps_the_phase_it_is_slow_in() -> None:
    """The same slow rank with a run-queue wait that cannot account for its 9 ms/step
    (0.4 ms; 5 ms, its peers as much or less), or where the kernel does not say (NaN:
    no /proc), is named with its phase, as before."""
    from scaletrain.observe.metrics.summary import advice

    for waits in ([0.3e-3, 0.4e-3, 0.2e-3], [0.3e-3, 5e-3, 0.3e-3], [5e-3] * 3, [math.nan] * 3):
        detector, named_at = _run(_crowded(waits))
        assert named_at == [1]
        s = detector.named[1]
        assert not s.waited_for_cpu and s.phase == "backward"
        assert "is slow in backward: 1.30x" in s.describe() and "CPU" not in s.describe()
        line = advice({"stragglers": [s.as_dict()], "ranks": [], "phases": {}})
        assert line is not None and "1.30x slower than its fastest peer in backward" in line


def _measured(
    slow: Callable[[int, int], tuple[float, float, float]], waits: tuple[float, float]
) -> list[RankWindow]:
    """One window of 2 ranks as the ledger builds it from 10 steps (Series, summarize):
    10 ms forward, 1 ms backward and 0.2 ms all-reduce each, plus what `slow(rank, step)`
    adds to them (forward, backward, comm); `waits`: each rank's run-queue wait per step
    (the window's total over 10 steps)."""
    from scaletrain.observe.metrics.clocks import StepTimes
    from scaletrain.observe.metrics.series import Series
    from scaletrain.observe.metrics.window import summarize

    ranks = []
    for rank in (0, 1):
        series = Series()
        for step in range(10):
            more = slow(rank, step)
            seconds = [0.0] * len(PHASES)
            seconds[DATA], seconds[FORWARD] = 0.1e-3, 10e-3 + more[0]
            seconds[PHASES.index("backward")], seconds[COMM] = 1e-3 + more[1], 0.2e-3 + more[2]
            series.add(StepTimes(seconds, sum(seconds)), 0.0, None, None)
        reduced = series.reduce()
        ranks.append(summarize(reduced, rank=rank, peer_group=0, sample=None, flops=None,
                               host="h", cpu_wait=waits[rank]))  # fmt: skip
    return ranks


def _starved(rank: int, step: int) -> tuple[float, float, float]:
    """Rank 1's backward waited 5 ms for a CPU in 6 of 10 steps; rank 0 waited for it in
    the all-reduce after them."""
    late = 5e-3 if step % 5 < 3 else 0.0
    return (0.0, late, 0.0) if rank == 1 else (0.0, 0.0, late)


def test_a_rank_starved_in_most_steps_of_a_window_is_named_with_its_wait() -> None:
    """A wait for a CPU read as a total over a window's steps is held against the mean
    excess, not the median's: rank 1 waited 30 ms over the 10 steps (and 2 ms more
    outside them), so 3.2 ms per step against a mean excess of 3 ms in backward, though
    its median backward is a starved step's, 5 ms over its peer's. Held against the
    median, it was named "slow in backward (6.00x)" on a clean 2-rank run that a second
    test worker's load starved. A wait under the mean excess (2.5 ms) still names the
    phase."""
    detector, named_at = _run([_measured(_starved, (0.1e-3, 3.2e-3))] * 2)
    assert named_at == [1]
    s = detector.named[1]
    assert s.phase == "backward" and s.slower == pytest.approx(6.0)
    assert s.waited_for_cpu and s.cpu_wait_s == pytest.approx(3.2e-3)
    detector, _ = _run([_measured(_starved, (0.1e-3, 2.5e-3))] * 2)
    assert not detector.named[1].waited_for_cpu


def test_one_stall_of_a_peer_does_not_clear_a_rank_slow_in_every_step() -> None:
    """Rank 1's forward is 3 ms slower in every step (its device), and it waited 1 ms per
    step for a CPU; rank 0 stalled 40 ms once, which lifts its mean forward above rank
    1's. Against its peer's median the rank is still 3 ms slower, more than its wait:
    named for forward, not for the CPU."""

    def slow(rank: int, step: int) -> tuple[float, float, float]:
        if rank == 1:
            return 3e-3, 0.0, 0.0
        return (40e-3 if step == 4 else 0.0), 0.0, 3e-3

    detector, named_at = _run([_measured(slow, (0.1e-3, 1e-3))] * 2)
    assert named_at == [1]
    s = detector.named[1]
    assert s.phase == "forward" and not s.waited_for_cpu
    assert s.excess_s == pytest.approx(3e-3)


def test_the_kernel_gives_this_threads_run_queue_wait_on_linux() -> None:
    """schedstat of the calling thread: its time on a CPU is the thread's CPU time; on a
    CPU plus waiting for one fit in the wall time that passed; a RunQueueClock's laps add
    up to its total. Without /proc (macOS) there is no number, and nothing fails."""
    import time

    from scaletrain.observe.metrics.runqueue import RunQueueClock, schedstat

    if not sys.platform.startswith("linux"):
        assert schedstat() is None and RunQueueClock().lap() is None
        return
    clock = RunQueueClock()
    assert clock.available
    start, cpu0, before = time.perf_counter(), time.thread_time(), schedstat()
    assert before is not None, "no /proc/self/task/<tid>/schedstat on this Linux"
    while time.thread_time() - cpu0 < 0.05 and time.perf_counter() - start < 20:
        pass
    after, cpu1, wall = schedstat(), time.thread_time(), time.perf_counter() - start
    assert after is not None
    on_cpu, waited = (after[0] - before[0]) / 1e9, (after[1] - before[1]) / 1e9
    # schedstat's sum is brought up to date at scheduler ticks: within one (10 ms at HZ=100).
    assert on_cpu == pytest.approx(cpu1 - cpu0, abs=0.011)
    assert waited >= 0 and after[2] >= before[2]
    assert on_cpu + waited <= wall + 0.011
    first, second = clock.lap(), clock.lap()
    assert first is not None and second is not None and first >= 0 and second >= 0
    total = clock.total()
    assert total is not None and total >= first + second - 1e-9
    # A thread id that is not this process's: not known, no number.
    assert RunQueueClock(tid=2**22 + 12345).lap() is None
