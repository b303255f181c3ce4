"""The step ledger without processes: phase accounting, CUDA events read late (fakes),
windows, the on-disk format and its reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.observe.metrics.clocks import CudaTimeline, WallTimeline
from scaletrain.observe.metrics.ledger import LedgerConfig, StepLedger
from scaletrain.observe.metrics.phases import (
    BACKWARD,
    COMM,
    DATA,
    FORWARD,
    OPTIMIZER,
    OTHER,
    PHASES,
)
from scaletrain.observe.metrics.records import peak_memory, phase_medians, read_run


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ledger(
    tmp_path: Path | None = None, every: int = 5, **kwargs: object
) -> tuple[StepLedger, FakeClock]:
    clock = FakeClock()
    ledger = StepLedger(
        LedgerConfig(out=tmp_path, every=every, flops=False, summary=False),
        timeline=WallTimeline(len(PHASES), clock=clock),
        **kwargs,  # type: ignore[arg-type]
    )
    return ledger, clock


def _step(ledger: StepLedger, clock: FakeClock, data: float = 1, fwd: float = 2, bwd: float = 3,
          comm: float = 0.5, opt: float = 0.25) -> None:  # fmt: skip
    ledger.push(DATA)
    clock.now += data
    ledger.data_arrived()
    clock.now += 0.1  # h2d
    ledger.forward_begin(True)
    clock.now += fwd
    ledger.backward_begin()
    clock.now += bwd
    ledger.compute_end()
    clock.now += comm
    ledger.backward_end()
    clock.now += 0.05  # zero_grad: other
    ledger.optimizer_begin()
    clock.now += opt
    ledger.optimizer_end()


def test_phases_tile_the_step_and_land_where_they_belong(tmp_path: Path) -> None:
    ledger, clock = _ledger(tmp_path)
    for _ in range(3):
        _step(ledger, clock)
    ledger.finish(collective=False)
    records = read_run(tmp_path)
    steps = records.ranks[0].steps
    assert [s.step for s in steps] == [1, 2, 3]
    s = steps[1]
    assert s.phases["data"] == pytest.approx(1) and s.phases["h2d"] == pytest.approx(0.1)
    assert s.phases["forward"] == pytest.approx(2) and s.phases["backward"] == pytest.approx(3)
    assert s.phases["comm"] == pytest.approx(0.5) and s.phases["optimizer"] == pytest.approx(0.25)
    assert s.phases["other"] == pytest.approx(0.05)
    assert sum(s.phases.values()) == pytest.approx(s.wall)
    assert s.wall == pytest.approx(6.9)
    assert steps[0].flags == ("warmup",) and steps[1].counted


def test_eval_and_checkpoint_absorb_what_runs_inside_them() -> None:
    ledger, clock = _ledger()
    _step(ledger, clock)
    ledger.begin_mode(7)  # checkpoint
    ledger.push(DATA)  # a loader inside a save still counts as the save
    clock.now += 4
    ledger.pop(DATA)
    ledger.end_mode(7)
    ledger.forward_begin(False)  # a no-grad forward: evaluation until training resumes
    clock.now += 2
    ledger.push(DATA)
    clock.now += 1
    ledger.data_arrived()
    ledger.end_eval()
    _step(ledger, clock, data=0)
    last = ledger.run.last
    assert last is not None
    assert last.seconds[PHASES.index("checkpoint")] == pytest.approx(4)
    assert last.seconds[PHASES.index("eval")] == pytest.approx(3)


class FakeEvent:
    """A CUDA event on a fake stream: completes when the test says the GPU got there."""

    gpu_time = 0.0
    done_upto = 0.0

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = FakeEvent.gpu_time

    def query(self) -> bool:
        return self.t is not None and self.t <= FakeEvent.done_upto

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before it completed: a synchronize"
        assert end.t is not None and self.t is not None
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        FakeEvent.done_upto = max(FakeEvent.done_upto, self.t or 0.0)


def test_cuda_timeline_reads_events_one_step_late_and_never_waits() -> None:
    FakeEvent.gpu_time = FakeEvent.done_upto = 0.0
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    timeline = CudaTimeline(len(PHASES), event_factory=factory)
    for step in range(3):
        for phase, seconds in ((FORWARD, 0.2), (BACKWARD, 0.3), (COMM, 0.1)):
            FakeEvent.gpu_time += seconds
            timeline.switch(phase)
        FakeEvent.gpu_time += 0.05
        timeline.close(OPTIMIZER, step)
        # The GPU lags: only the previous step has completed.
        FakeEvent.done_upto = FakeEvent.gpu_time - 0.6
        ready = timeline.ready()
        assert [t.tag for t in ready] == ([] if step == 0 else [step - 1])
    rest = timeline.flush()
    assert [t.tag for t in rest] == [2]
    assert rest[0].seconds[BACKWARD] == pytest.approx(0.3)
    assert rest[0].wall == pytest.approx(0.65)
    assert sum(rest[0].seconds) == pytest.approx(rest[0].wall)
    # Events are reused: 3 steps x 4 marks + 1 start would be 13 without the pool.
    assert len(made) < 13


def test_window_gather_spreads_name_the_extreme_ranks(tmp_path: Path) -> None:
    rows: list[list[float]] = []

    def gather(values: list[float]) -> list[list[float]]:
        # Rank 1 is 50% slower in forward than this rank (0).
        other = list(values)
        other[0] = 1.0
        other[4 + FORWARD] *= 1.5
        other[4 + COMM] = 0.0  # the slow rank arrives last and waits least
        rows.append(values)
        return [values, other]

    ledger, clock = _ledger(tmp_path, every=10, world_size=2, gather=gather)
    for _ in range(20):
        _step(ledger, clock)
    assert len(ledger.windows) == 2  # steps 10 and 20
    spread = ledger.windows[-1].spreads["forward"]
    assert spread.min_rank == 0 and spread.max_rank == 1
    assert spread.max == pytest.approx(3.0) and spread.min == pytest.approx(2.0)
    lines = (tmp_path / "observe" / "windows.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["spreads"]["forward"]["max_rank"] == 1
    ledger.finish()
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())
    assert summary["phases"]["forward"]["max_rank"] == 1
    # Forward 3.0 vs 2.0 s of a ~7 s step: named, with forward as the phase.
    assert [s["rank"] for s in summary["stragglers"]] == [1]
    assert summary["stragglers"][0]["phase"] == "forward"


def test_reader_helpers_give_what_a_planner_compares_with(tmp_path: Path) -> None:
    ledger, clock = _ledger(tmp_path)
    for _ in range(6):
        _step(ledger, clock)
    ledger.finish(collective=False)
    medians = phase_medians(tmp_path)
    assert medians[0]["forward"] == pytest.approx(2.0)
    assert medians[0]["step"] == pytest.approx(6.9)
    peaks = peak_memory(tmp_path)
    assert peaks[0]["allocated_peak"] is None  # no memory sampler given here
    with pytest.raises(FileNotFoundError, match="no ledger files"):
        read_run(tmp_path / "elsewhere")


def test_a_killed_process_leaves_a_readable_file(tmp_path: Path) -> None:
    ledger, clock = _ledger(tmp_path)
    for _ in range(2):
        _step(ledger, clock)
    ledger.close()
    path = tmp_path / "observe" / "rank0.jsonl"
    path.write_text(path.read_text() + '{"kind":"step","step":3,"t"')  # cut mid-line
    assert [s.step for s in read_run(tmp_path).ranks[0].steps] == [1, 2]


def test_other_is_the_rest_and_starts_after_the_first_hook() -> None:
    ledger, clock = _ledger()
    clock.now += 100  # building the model: no step's time
    _step(ledger, clock)
    assert ledger.run.steps == 0  # step 1 is warm-up: not counted
    _step(ledger, clock)
    assert ledger.run.last is not None and ledger.run.last.wall == pytest.approx(6.9)
    assert ledger.run.last.seconds[OTHER] == pytest.approx(0.05)


def test_a_cached_peak_a_run_beats_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run above 100% MFU proves the cached peak was measured while the device was
    busy: the summary says so and drops it from the cache, so the next run measures it
    again (before, every later run on the machine reported 128-134%). Other entries stay."""
    from scaletrain.observe.metrics.flops import _cache_file, measure_peak

    monkeypatch.setenv("SCALETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    peak = measure_peak("cpu", "fp32", device_name="cpu", seconds=0.02)
    measure_peak("cpu", "fp32", device_name="cpu", processes=2, seconds=0.02)
    assert len(json.loads(_cache_file().read_text())) == 2
    ledger, clock = _ledger(tmp_path / "run", every=5)
    ledger.peak_measured = peak
    ledger.flops_per_step = 100 * peak  # more than the peak in each ~7 s step
    for _ in range(10):
        _step(ledger, clock)
    ledger.finish()
    summary = json.loads((tmp_path / "run" / "observe" / "summary.json").read_text())
    assert summary["mfu"]["measured"] > 1 and "measurement error" in summary["mfu"]["error"]
    left = json.loads(_cache_file().read_text())
    assert list(left) == [k for k in left if "procs=2" in k] and len(left) == 1


def test_a_one_process_run_without_a_process_group_gets_its_summary(tmp_path: Path) -> None:
    """rt.shutdown finishes the ledger without a collective where no process group
    exists, as in every 1-process run: its summary.json was never written (found on a
    GPU machine, where the CUDA ledger's test reads it)."""
    import torch
    from torch import nn

    import scaletrain as st

    _one_process_loop(st.LedgerConfig(out=tmp_path, every=5))
    run = read_run(tmp_path)
    assert run.summary is not None and (tmp_path / "observe" / "summary.json").is_file()
    assert run.summary["ranks"] and "forward" in run.summary["phases"]
    # A failed run skips it, as rt.shutdown(failed=True) says.
    failed = tmp_path / "failed"
    rt = st.init(strategy="single", env="local", ledger=st.LedgerConfig(out=failed, every=5))
    bare = nn.Linear(8, 8)
    model, _ = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    for _ in range(12):
        model(torch.randn(4, 8, device=rt.device)).sum().backward()
    rt.shutdown(failed=True)
    assert read_run(failed).summary is None


def test_the_flops_peak_measurement_is_not_counted_as_training_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's FLOP/s measurement (4096 x 4096 matrices on a GPU) ran after the
    memory's starting point: a GPU run's CUDA peak held its 192 MiB (a split-net run
    on an H200: 257 MiB against 0.02 planned). The starting point now follows it (and
    on a GPU, CUDA's peak counters restart there)."""
    import torch
    from torch import nn

    import scaletrain as st
    import scaletrain.observe.metrics.flops as flops
    import scaletrain.observe.metrics.memory as memory

    calls: list[str] = []
    monkeypatch.setattr(flops, "measure_peak", lambda *a, **k: calls.append("peak") or 1e9)
    real = memory.reset_rss_peak
    monkeypatch.setattr(memory, "reset_rss_peak", lambda: calls.append("setup") or real())
    ledger = st.LedgerConfig(out=tmp_path, every=5, flops=True, summary=False)
    rt = st.init(strategy="single", env="local", ledger=ledger)
    bare = nn.Linear(4, 4)
    rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    rt.shutdown()
    assert calls == ["peak", "setup"]


def _one_process_loop(ledger: object) -> None:
    import torch
    from torch import nn

    import scaletrain as st

    rt = st.init(strategy="single", env="local", ledger=ledger)  # type: ignore[arg-type]
    bare = nn.Linear(8, 8)
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    for _ in range(12):
        loss = model(torch.randn(4, 8, device=rt.device)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    rt.shutdown()


def test_a_plain_loop_ends_with_one_line_and_the_table_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 20: a plain loop printed the whole phase table (20 lines) at
    rt.shutdown(); the default is one line now: step time, MFU, the straggler if any,
    where the files are; LedgerConfig(summary="table") gives the table."""
    import scaletrain as st
    import scaletrain.observe.metrics.flops as flops

    monkeypatch.setattr(flops, "measure_peak", lambda *a, **k: 1e9)
    capsys.readouterr()
    _one_process_loop(st.LedgerConfig(out=tmp_path, every=5))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("scaletrain: ") and " ms/step (1 rank, " in line, line
    assert "MFU " in line and "of the measured fp32 peak" in line, line
    assert f"ledger in {tmp_path / 'observe'} (scaletrain report {tmp_path})" in line, line
    assert "LedgerConfig(summary='table')" in line
    # A straggler is named in the line; a ledger without files says so.
    from scaletrain.observe.metrics.summary import summary_line

    summary = read_run(tmp_path).summary
    assert summary is not None
    summary["stragglers"] = [{"rank": 1, "phase": "forward", "slower": 1.3, "cost_s": 0.004}]
    assert "straggler: rank 1 slow in forward (1.30x)" in summary_line(summary, None)
    assert "no files (LedgerConfig(out=RUN) keeps them)" in summary_line(summary, None)
    _one_process_loop(st.LedgerConfig(out=tmp_path / "table", every=5, summary="table"))
    err = capsys.readouterr().err
    assert "where the time goes" in err and "MFU:" in err
    with pytest.raises(st.ConfigError, match="LedgerConfig\\(summary='tabel'\\)"):
        st.init(strategy="single", env="local", ledger=st.LedgerConfig(summary="tabel"))  # type: ignore[arg-type]


class FakeRunQueue:
    """A RunQueueClock whose wait the test advances (None: a kernel that does not say)."""

    def __init__(self, known: bool = True) -> None:
        self.known = known
        self.waited = self._last = 0.0

    def lap(self) -> float | None:
        lap, self._last = self.waited - self._last, self.waited
        return lap if self.known else None

    def total(self) -> float | None:
        return self.waited if self.known else None


@pytest.mark.parametrize("known", [True, False])
def test_a_rank_that_waited_for_a_cpu_is_named_for_its_wait(tmp_path: Path, known: bool) -> None:
    """Each window carries the training thread's run-queue wait per step (read once per
    window); gathered with the rest, it names a rank slow in forward because it waited
    for a CPU by that wait, in windows.jsonl and summary.json. Where the kernel does not
    say, the rank is named by its phase and no CPU wait is claimed."""
    from scaletrain.observe.metrics.window import _SCALARS, MEANS_AT, PHASES_AT, SCALARS_AT

    slot = SCALARS_AT + _SCALARS.index("cpu_wait")

    def gather(values: list[float]) -> list[list[float]]:
        other = list(values)
        other[0] = 1.0
        for at in (PHASES_AT, MEANS_AT):  # the medians and the means
            other[at + FORWARD] -= 1.0  # this rank's forward is 3.0 s, the other's 2.0
            other[at + COMM] += 1.0  # and the other waits for it
        other[slot] = 0.01 if known else float("nan")
        return [values, other]

    ledger, clock = _ledger(tmp_path, every=10, world_size=2, gather=gather)
    runqueue = FakeRunQueue(known)
    ledger.runqueue = runqueue  # type: ignore[assignment]
    for _ in range(20):
        _step(ledger, clock, fwd=3.0)
        runqueue.waited += 1.2  # s per step on a run queue: more than its 1.0 s excess
    ledger.finish()
    window = json.loads((tmp_path / "observe" / "windows.jsonl").read_text().splitlines()[-1])
    waits = [r["cpu_wait"] for r in window["ranks"]]
    assert waits == ([pytest.approx(1.2), 0.01] if known else [None, None])
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())
    assert summary["ranks"][0]["cpu_wait"] == (pytest.approx(1.2) if known else None)
    [s] = summary["stragglers"]
    assert s["rank"] == 0 and s["waited_for_cpu"] is known
    if known:
        assert s["cpu_wait_s"] == pytest.approx(1.2)
        advice = summary["advice"]
        assert "rank 0 waited 1200.0 ms/step for a CPU (other processes on its host)" in advice
        from scaletrain.observe.report.html import _facts

        assert "rank 0 waited 1200.0 ms/step for a CPU" in _facts(read_run(tmp_path))
    else:
        assert s["cpu_wait_s"] is None and s["phase"] == "forward"
        assert "CPU" not in summary["advice"]


def test_compile_time_is_its_own_phase_wherever_torch_compiles(tmp_path: Path) -> None:
    """Issue 28: torch.compile's time (dynamo's compile callbacks drive compile_begin and
    compile_end) is the compile phase, taken out of the phase it interrupts: forward,
    backward (AOT autograd compiles a backward lazily at its first run), evaluation; the
    phases still add up to the step's wall time, and the step is flagged and left out of
    the statistics."""
    ledger, clock = _ledger(tmp_path)
    ledger.compile_begin()  # before the first hook: no step's time
    clock.now += 50
    ledger.compile_end()
    ledger.push(DATA)
    clock.now += 1
    ledger.data_arrived()
    ledger.forward_begin(True)
    clock.now += 0.5
    ledger.compile_begin()  # dynamo traces the forward...
    clock.now += 2
    ledger.compile_begin()  # ...and a nested compile (older torch) is counted once
    clock.now += 1
    ledger.compile_end()
    clock.now += 1
    ledger.compile_end()
    clock.now += 0.5
    ledger.backward_begin()
    clock.now += 0.25
    ledger.compile_begin()  # the lazily compiled backward
    clock.now += 1.5
    ledger.compile_end()
    clock.now += 0.25
    ledger.compute_end()
    ledger.backward_end()
    ledger.optimizer_begin()
    clock.now += 0.25
    ledger.optimizer_end()
    for _ in range(2):
        _step(ledger, clock)
    ledger.forward_begin(False)  # evaluation: its recompilation is compile's
    clock.now += 1
    ledger.compile_begin()
    clock.now += 3
    ledger.compile_end()
    ledger.end_eval()
    _step(ledger, clock)
    ledger.finish(collective=False)
    steps = read_run(tmp_path).ranks[0].steps
    first, fourth = steps[0], steps[3]
    assert first.phases["compile"] == pytest.approx(5.5)
    assert first.phases["forward"] == pytest.approx(1.0)
    assert first.phases["backward"] == pytest.approx(0.5)
    assert first.wall == pytest.approx(8.25) and sum(first.phases.values()) == pytest.approx(8.25)
    assert set(first.flags) == {"compile", "warmup"}
    assert steps[1].counted and steps[2].counted and steps[1].phases["compile"] == 0
    assert fourth.phases["compile"] == pytest.approx(3) and fourth.phases["eval"] == pytest.approx(
        1
    )
    assert fourth.phases["forward"] == pytest.approx(2) and fourth.flags == ("compile",)
    assert sum(fourth.phases.values()) == pytest.approx(fourth.wall) and not fourth.counted
    assert (ledger.compiled.seconds, ledger.compiled.steps) == (pytest.approx(8.5), 2)
    assert (ledger.compiled.first, ledger.compiled.last) == (1, 4)
    assert ledger.run.steps == 2  # steps 2 and 3: the statistics never saw a compile


def _printed(summary: dict[str, object]) -> str:
    import io

    from rich.console import Console

    from scaletrain.observe.metrics.summary import print_summary

    console = Console(file=io.StringIO(), width=250)
    print_summary(summary, console.print)
    return " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]


def test_a_rank_that_recompiles_is_no_straggler_and_its_steps_no_slow_steps(
    tmp_path: Path,
) -> None:
    """Issue 28: rank 0 recompiles 4 s in each of steps 21-30 (a shape that changes on it
    alone); its peer does not. Those steps are left out of its window (which still has
    the steps for a verdict) and of the run: nobody is named, the step time and MFU are
    training's (counted, the run's mean step was 7.9 s and its MFU 8.7%), and the
    compile seconds have their own line in the summary, the one-line summary and the
    report."""
    from scaletrain.observe.metrics.summary import summary_line
    from scaletrain.observe.metrics.window import _SCALARS, SCALARS_AT
    from scaletrain.observe.report.html import _facts

    def gather(values: list[float]) -> list[list[float]]:
        other = list(values)
        other[0] = 1.0
        for name in ("compile_s", "compile_steps", "compile_first", "compile_last"):
            other[SCALARS_AT + _SCALARS.index(name)] = 0.0  # the peer compiled nothing
        return [values, other]

    ledger, clock = _ledger(tmp_path, every=20, world_size=2, gather=gather)
    ledger.flops_per_step = 6.9e9
    ledger.peak_measured = 1e10
    for step in range(1, 41):
        _step(ledger, clock)
        if 20 <= step < 30:  # the next step's forward recompiles
            ledger.compile_begin()
            clock.now += 4
            ledger.compile_end()
    ledger.finish()
    assert ledger.windows[-1].ranks[0].steps == 10  # a verdict was given: none
    assert not ledger.detector.named and not ledger.detector.candidates
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())
    assert summary["stragglers"] == [] and summary["advice"] is None
    assert summary["phases"]["step"]["median"] == pytest.approx(6.9)
    assert summary["mfu"]["measured"] == pytest.approx(0.1)
    assert summary["compile"] == {
        "seconds": pytest.approx(40), "rank": 0, "median": pytest.approx(20),
        "steps": 10, "first_step": 21, "last_step": 30,
    }  # fmt: skip
    assert summary["ranks"][0]["compile_s"] == pytest.approx(40)
    assert summary["ranks"][1]["compile_steps"] == 0
    window = json.loads((tmp_path / "observe" / "windows.jsonl").read_text().splitlines()[-1])
    assert window["ranks"][0]["compile_s"] == pytest.approx(40)
    assert "compile 40.0 s in steps 21-30, rank 0 (not in the step time)" in summary_line(
        summary, tmp_path
    )
    out = _printed(summary)
    assert "warm-up, compiling and profiled steps left out" in out
    assert "torch.compile: 40.0 s in steps 21-30, rank 0 (the slowest rank)" in out
    assert "torch.compile" in _facts(read_run(tmp_path))
    # A run that compiled nothing says nothing about it.
    plain, clock = _ledger(tmp_path / "plain", every=5)
    for _ in range(6):
        _step(plain, clock)
    plain.finish()
    summary = json.loads((tmp_path / "plain" / "observe" / "summary.json").read_text())
    assert summary["compile"] is None and "compile" not in summary_line(summary, None)
    assert "compil" not in _printed(summary)


def test_a_run_of_only_its_warm_up_says_no_step_was_measured(tmp_path: Path) -> None:
    """A run of one step (`--max-steps 1`, a smoke test) has only its warm-up, which the
    statistics leave out: its summary printed a table of dashes with "rank -1", and its
    line "- ms/step (..., 0 steps)", and `scaletrain report` of it raised a TypeError.
    Each says why there is nothing to show."""
    from scaletrain.observe.metrics.summary import summary_line

    ledger, clock = _ledger(tmp_path, world_size=1)
    _step(ledger, clock)
    ledger.finish()
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())
    out = _printed(summary)
    assert out.startswith(
        "where the time goes: no step measured: step 1 was warm-up or profiled, which the "
        "step times leave out (each start's first step is its warm-up); a run of more steps "
        "shows them"
    ), out
    assert "rank -1" not in out and "┃" not in out
    line = summary_line(summary, tmp_path)
    assert line.startswith("scaletrain: no step measured: step 1 was warm-up"), line
    assert "ms/step" not in line
    from scaletrain.observe.report.html import write_report

    page = write_report(tmp_path).read_text()  # it raised a TypeError on the step's None
    assert "median step</th><td>no step measured: step 1 was warm-up" in page
    # The step sections say why they are empty (they were blank charts).
    assert page.count("<p class='note'>No step measured: step 1 was warm-up") == 3, page
    # Memory: the ledger writes it as a window closes, so a start this short has none
    # there; the summary's peak (what the console printed) is drawn.
    assert '"name":"RSS"' not in page
    summary["ranks"][0]["rss_peak"] = 123 * 2**20
    (tmp_path / "observe" / "summary.json").write_text(json.dumps(summary))
    assert '"name":"RSS"' in write_report(tmp_path).read_text()
    two, clock = _ledger(tmp_path / "two", world_size=1)
    for _ in range(2):
        _step(two, clock)
    two.finish()
    summary = json.loads((tmp_path / "two" / "observe" / "summary.json").read_text())
    assert "mean of 1 step in 1-2" in _printed(summary)  # the table, of the one counted
    assert "(1 rank, 1 step)" in summary_line(summary, None)


def test_report_output_is_a_new_file_a_report_or_a_directory(tmp_path: Path) -> None:
    """--output in a directory that does not exist ended in a FileNotFoundError's
    traceback, --output DIR in an IsADirectoryError's, and --output of a file the user
    saved replaced it."""
    from scaletrain.observe.report.html import write_report
    from tests.inprocess import run_cli

    run = tmp_path / "run"
    ledger, clock = _ledger(run)
    for _ in range(3):
        _step(ledger, clock)
    ledger.finish()
    for bad, words in (
        (tmp_path / "nodir" / "x.html", f"the directory {tmp_path / 'nodir'} does not exist"),
        (tmp_path / "notes.txt", "exists and is not a scaletrain report: writing the report"),
    ):
        (tmp_path / "notes.txt").write_text("my notes")
        done = run_cli("report", str(run), "--output", str(bad), cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"scaletrain: error: --output {bad}: " in done.stderr and words in done.stderr
        assert done.stderr.count("scaletrain: error") == 1, done.stderr
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    # "new/" names a directory, which must exist (it was written as a file named new).
    done = run_cli("report", str(run), "--output", f"{tmp_path / 'new'}/", cwd=tmp_path)
    assert (
        done.returncode == 2 and f"the directory {tmp_path / 'new'} does not exist" in done.stderr
    )
    assert not (tmp_path / "new").exists()
    (tmp_path / "out").mkdir()
    assert write_report(run, tmp_path / "out") == tmp_path / "out" / "report.html"
    assert write_report(run, tmp_path / "out" / "report.html").is_file()  # ours: rewritten


@pytest.mark.timeout(120)
def test_a_compiled_model_shows_its_compile_time_as_the_compile_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28, through rt.setup's hooks and dynamo's own compile callbacks: a model
    compiled before rt.setup (aot_eager: dynamo's trace, AOT autograd, a backward compiled
    lazily at its first run) trained by a plain loop. Its compile seconds are the compile
    phase of the steps that compiled (the first training step after the FLOP count, and a
    recompilation for a new shape), those steps are left out of the statistics, and the
    end-of-run line says what compiling cost. torch._dynamo.reset() (which drops every
    compile callback) does not stop it.

    Before, the FLOP count (on by default) ran the first step under FlopCounterMode,
    under which dynamo skips a frame and torch marks its code to be skipped for good:
    the model never compiled, it ran eager for the whole run; compiled after rt.setup
    too."""
    import torch
    import torch._dynamo
    from torch import nn

    import scaletrain as st
    import scaletrain.observe.metrics.flops as flops

    monkeypatch.setattr(flops, "measure_peak", lambda *a, **k: 1e9)
    torch._dynamo.reset()
    capsys.readouterr()
    try:
        rt = st.init(strategy="single", env="local", ledger=st.LedgerConfig(out=tmp_path, every=5))
        torch.manual_seed(0)
        bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        compiled = torch.compile(bare, backend="aot_eager")
        model, opt = rt.setup(compiled, torch.optim.SGD(bare.parameters(), lr=0.1))
        torch._dynamo.reset()  # drops every compile callback: the next forward restores ours
        for i in range(12):
            x = torch.randn(5 if i == 7 else 4, 8, device=rt.device)  # step 8: a new shape
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        rt.shutdown()
    finally:
        torch._dynamo.reset()
    run = read_run(tmp_path)
    steps = {s.step: s for s in run.ranks[0].steps}
    assert [k for k, s in steps.items() if s.phases["compile"] > 0] == [2, 8]
    for k in (2, 8):
        s = steps[k]
        assert "compile" in s.flags and not s.counted
        assert s.phases["compile"] > 0.5 * s.wall  # the step was mostly compiling
        assert sum(s.phases.values()) == pytest.approx(s.wall, abs=2e-5)  # us on disk
    assert steps[1].flags == ("flops", "warmup")  # counted eagerly: nothing was marked
    assert all(steps[k].counted for k in steps if k not in (1, 2, 8))
    summary = run.summary
    assert summary is not None and summary["stragglers"] == []
    c = summary["compile"]
    assert (c["steps"], c["first_step"], c["last_step"]) == (2, 2, 8)
    # Each step's phases are on disk to the microsecond, the summary's sum is not: two
    # roundings of up to 0.5 us each (a relative 1e-6 of a 0.7 s compile is 0.7 us).
    on_disk = steps[2].phases["compile"] + steps[8].phases["compile"]
    assert c["seconds"] == pytest.approx(on_disk, rel=0, abs=1e-6)
    assert summary["phases"]["step"]["median"] < c["seconds"] / 20  # training's step
    assert summary["phases"]["compile"]["max"] == 0  # no counted step compiled
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "ms/step" in line]
    assert " in 2 steps from 2 to 8 (not in the step time)" in line, line

    # Compiled after rt.setup, the hooks run inside the compiled model, where counting
    # FLOPs kept it from ever compiling: no FLOP count then (said once), and it compiles.
    after = tmp_path / "after"
    try:
        rt = st.init(strategy="single", env="local", ledger=st.LedgerConfig(out=after, every=5))
        model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
        model = torch.compile(model, backend="eager")
        for _ in range(3):
            loss = model(torch.randn(4, 8, device=rt.device)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        rt.shutdown()
    finally:
        torch._dynamo.reset()
    err = capsys.readouterr().err
    assert err.count("no FLOP count, so no MFU: the model was compiled after rt.setup") == 1
    steps = {s.step: s for s in read_run(after).ranks[0].steps}
    assert steps[1].phases["compile"] > 0 and "compile" in steps[1].flags
    assert steps[2].phases["compile"] == steps[3].phases["compile"] == 0


def test_the_ledgers_flops_are_the_models_with_or_without_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first step's count, for MFU, held full checkpointing's recomputed forward:
    `--ac full` reported a higher MFU for a slower step."""
    import torch

    import scaletrain as st
    from scaletrain.planner.models import resolve_model
    from scaletrain.testing import launcher_variables

    for var in launcher_variables():
        monkeypatch.delenv(var)
    planned = resolve_model("llama", None, seq_len=64, batch_size=4)
    x, y = planned.example(4)
    counted = {}
    for ac in ("none", "full"):
        torch.manual_seed(0)
        with st.init(strategy=st.DDP(ac=ac)) as rt:
            net = planned.build()
            model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))
            for _ in range(2):
                rt.forward_backward(model, x, y, planned.loss)
                rt.step(opt)
                opt.zero_grad()
            assert rt.ledger is not None
            counted[ac] = rt.ledger.flops_per_step
    assert counted["none"] and counted["full"] == counted["none"], counted


def test_checkpoint_advice_holds_whether_background_saves_are_on_or_not() -> None:
    """A run with --async-save on was told "--async-save writes them in the background,
    or save less often": the flag it had. Saving less often comes first; the background
    save's own share (its copy of the state) is named."""
    from scaletrain.errors import use_cli_names
    from scaletrain.observe.metrics.summary import advice

    phases = {p: {"median": 0.0} for p in ("data", "comm", "sync", "eval")}
    summary = {"stragglers": [], "ranks": [{"peer_group": 0}],
               "phases": {**phases, "checkpoint": {"median": 0.4}, "step": {"median": 1.0}}}  # fmt: skip
    use_cli_names()
    said = advice(summary)
    assert said is not None and said.startswith(
        "Checkpoints stall training 40% of the time: save less often; --async-save writes"
    ), said
    assert "where it is on already, this is the copy of the state it takes first" in said


def test_a_start_resumed_from_an_older_checkpoint_supersedes_what_followed_it(
    tmp_path: Path,
) -> None:
    """A run that logged steps 1-10, then resumed from its checkpoint at step 5 and went
    on to 12, kept both copies of steps 6-10 in its ledger and metrics.jsonl: the
    report's lines ran 1-10 and back to 6, and its step statistics counted 6-10 twice."""
    from scaletrain.observe.metrics.phases import PHASES
    from scaletrain.observe.report.html import _metrics

    def step(s: int, wall: float) -> dict[str, object]:
        return {"kind": "step", "step": s, "t": float(s), "wall": wall,
                "p": [0.0] * len(PHASES), "flags": []}  # fmt: skip

    def header(start: int, unix: float, world: int = 2) -> dict[str, object]:
        return {"kind": "run", "start_step": start, "unix": unix, "world_size": world}

    def write(rank: int, lines: list[dict[str, object]]) -> None:
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (tmp_path / "observe" / f"rank{rank}.jsonl").write_text(text)

    (tmp_path / "observe").mkdir()
    first = [header(0, 100.0, 4), *(step(s, 1.0) for s in range(1, 11))]
    first += [{"kind": "memory", "step": 10, "rss_peak": 900}]
    # The later start, of 2 ranks: its header written twice (a run directory given
    # twice), the first saying step 0, which supersedes nothing by itself.
    later = [header(0, 200.0), header(5, 200.1), *(step(s, 2.0) for s in range(6, 13))]
    for rank in range(4):
        write(rank, first + (later if rank < 2 else []))
    ranks = read_run(tmp_path).ranks
    for rank in (0, 1):
        assert [s.step for s in ranks[rank].steps] == list(range(1, 13))
        assert [s.wall for s in ranks[rank].steps[5:]] == [2.0] * 7  # the later start's
        assert ranks[rank].memory == []  # step 10's was the superseded start's
    for rank in (2, 3):  # not in the later start: its steps 1-5 stand, 6-10 are gone
        assert [s.step for s in ranks[rank].steps] == list(range(1, 6))
    metrics = [{"event": "train", "step": s, "loss": 1.0} for s in (5, 10)]
    metrics += [{"event": "eval", "step": 10, "val_loss": 1.0}]
    metrics += [{"event": "train", "step": s, "loss": 0.5} for s in (10, 15)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    kept = [(r["event"], r["step"], r["loss"]) for r in _metrics(tmp_path) if "loss" in r]
    assert kept == [("train", 5, 1.0), ("train", 10, 0.5), ("train", 15, 0.5)]
    assert not [r for r in _metrics(tmp_path) if r["event"] == "eval"]
