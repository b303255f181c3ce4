"""The planner's formulas and rows: collectives, the model profile, memory and time per layout."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.plan.api import throughput
from scaletrain.plan.comm import CommModel, collective_time, fit_link
from scaletrain.plan.estimate import Compute, estimate
from scaletrain.plan.hardware import PROFILES, Hardware, Link
from scaletrain.plan.layouts import Layout, layouts_for
from scaletrain.plan.profile import profile_model
from scaletrain.strategies.partition import list_layers


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 8), torch.randint(0, 4, (b,))


def _adam(ps: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps)  # type: ignore[arg-type]


def test_ring_collectives_move_the_textbook_bytes() -> None:
    link = Link(alpha=0.0, bandwidth=1.0)
    assert collective_time("all_reduce", 1000, 4, link) == pytest.approx(2 * 3 / 4 * 1000)
    assert collective_time("all_gather", 1000, 4, link) == pytest.approx(3 / 4 * 1000)
    assert collective_time("reduce_scatter", 1000, 8, link) == pytest.approx(7 / 8 * 1000)
    assert collective_time("send", 1000, 2, link) == pytest.approx(1000)
    # alpha per message: 2(N-1) for a ring all-reduce, N-1 for an all-gather.
    slow = Link(alpha=1.0, bandwidth=1e30)
    assert collective_time("all_reduce", 1, 4, slow) == pytest.approx(6)
    assert collective_time("all_gather", 1, 4, slow) == pytest.approx(3)
    assert collective_time("all_reduce", 10**9, 1, link) == 0.0


def test_fit_link_recovers_alpha_and_bandwidth() -> None:
    truth = Link(alpha=20e-6, bandwidth=2e9)
    samples = [(float(b), collective_time("all_reduce", b, 4, truth)) for b in (1e4, 1e6, 1e8)]
    fitted = fit_link("all_reduce", 4, samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_profile_comes_from_the_model_itself() -> None:
    p = profile_model(_mlp, _example(2), nn.functional.cross_entropy, _adam)
    params = (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert p.param_bytes == params and p.grad_bytes == params
    assert p.optimizer_bytes == 2 * params  # Adam: exp_avg and exp_avg_sq
    # Forward 2*B*(8*16 + 16*4); backward: both weight grads, and the input grad of the
    # second Linear only (the batch needs none).
    fwd = 2 * 2 * (8 * 16 + 16 * 4)
    assert p.flops == fwd + 2 * 2 * (8 * 16 + 16 * 4) + 2 * 2 * 16 * 4
    assert p.modules["0"].output_bytes == 2 * 16 * 4
    assert p.activation_bytes > 0


def _rows(hw: Hardware, devices: int = 2) -> dict[str, object]:
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    comm = CommModel(default=Link(1e-5, 1e9))
    compute = Compute(fixed=0.001, per_sample=0.001, optimizer=0.002, source="test")
    out = {}
    for layout in layouts_for(devices, batch=8, layers=len(layers), tensor_ok=False):
        out[layout.label] = estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute, comm=comm, hw=hw,
            overlap=0.0,
        )  # fmt: skip
    return out


def test_fsdp_shards_model_state_ddp_does_not() -> None:
    rows = _rows(PROFILES["h100-sxm"])
    ddp, fsdp = rows["ddp dp=2"], rows["fsdp dp=2"]
    assert fsdp.memory.optimizer == pytest.approx(ddp.memory.optimizer / 2, abs=1)  # type: ignore[attr-defined]
    assert fsdp.memory.params < ddp.memory.params  # type: ignore[attr-defined]
    # DDP's gradients are its buckets, made at setup: not part of the growth.
    assert ddp.memory.growth == ddp.memory.total - ddp.memory.params - ddp.memory.grads  # type: ignore[attr-defined]


def test_pipeline_rows_have_a_bubble_and_gpipe_holds_more_activations() -> None:
    rows = _rows(PROFILES["h100-sxm"])
    f1b, gpipe = rows["pipeline pp=2 1f1b m=4"], rows["pipeline pp=2 gpipe m=4"]
    assert f1b.time.bubble > 0  # type: ignore[attr-defined]
    assert gpipe.memory.activations > f1b.memory.activations  # type: ignore[attr-defined]
    assert rows["ddp dp=2"].time.bubble == 0  # type: ignore[attr-defined]


def test_the_busiest_stage_waits_for_a_microbatch_of_each_other_stage() -> None:
    # It was (pp-1)/M of the busiest stage's own work, whatever the others held: the
    # ConvNet's 2-stage pipeline, whose first stage holds most FLOPs, predicted +56%.
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")
    free = CommModel(default=Link(0, 1e15))
    layout = Layout("pipeline", pp=2, schedule="1f1b", microbatches=4)

    def row(build: Any) -> Any:
        p = profile_model(build, _example(8), nn.functional.cross_entropy, _adam)
        with torch.device("meta"):
            layers = list_layers(build())
        return estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute, comm=free,
            hw=PROFILES["h100-sxm"], overlap=0.0,
        ).time  # fmt: skip

    whole = 0.001 * 8  # the whole model's forward and backward of the batch
    for build in (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512)),
    ):
        t = row(build)
        # The other stage's share of the work, one microbatch of M=4 at each end.
        assert t.bubble == pytest.approx((whole - t.compute) / 4)
    # With one stage far busier, far less than (pp-1)/M of its own work.
    assert t.bubble < 0.5 * t.compute / 4


def test_rows_that_do_not_fit_say_where() -> None:
    tiny = Hardware("tiny", "a device with 1 KB", 1024, {"32": 1e12}, Link(0, 1e9), Link(0, 1e9))
    for row in _rows(tiny).values():
        assert not row.fits  # type: ignore[attr-defined]
        assert "over" in row.overflow  # type: ignore[attr-defined]


def test_oversubscribed_cores_slow_compute_down() -> None:
    two = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e9), Link(0, 1e9), cores=2)
    many = Hardware("cpu", "8 cores", 10**12, {}, Link(0, 1e9), Link(0, 1e9), cores=8)
    slow = _rows(two, devices=4)["ddp dp=4"].time.compute  # type: ignore[attr-defined]
    fast = _rows(many, devices=4)["ddp dp=4"].time.compute  # type: ignore[attr-defined]
    assert slow == pytest.approx(2 * fast)


def test_layouts_cover_every_mesh_the_model_allows() -> None:
    labels = [x.label for x in layouts_for(4, batch=32, layers=9, tensor_ok=True)]
    assert "ddp dp=4" in labels and "fsdp dp=4" in labels and "tensor tp=4" in labels
    assert "pipeline pp=4 1f1b m=4" in labels and "pipeline pp=4 gpipe m=4" in labels
    assert "fsdp x tp dp=2,tp=2" in labels and "ddp x pp dp=2,pp=2 1f1b m=4" in labels
    # Without Linear pairs no tensor rows; with 3 layers no 4-stage pipeline.
    labels = [x.label for x in layouts_for(4, batch=32, layers=3, tensor_ok=False)]
    assert not any("tp" in x or "pp=4" in x for x in labels)
    assert layouts_for(1, batch=8, layers=3, tensor_ok=True) == [Layout("ddp", dp=1)]


def test_paper_plan_for_a_cluster_recommends_the_fastest_that_fits() -> None:
    import scaletrain as st

    plan = st.plan("gpt", devices=16, hardware="h100-sxm")
    assert plan.nodes == 2  # 8 H100 per node
    fitting = [r for r in plan.rows if r.fits]
    # Compared by throughput: a dp=16 step takes 16 batches, a pp=16 step one.
    assert plan.recommended is max(fitting, key=lambda r: throughput(r, 32))
    assert plan.recommended.layout.label in plan.reason
    labels = [r.layout.label for r in plan.rows]
    assert "tensor tp=16" not in labels  # 4 heads do not split 16 ways
    assert "fsdp x tp dp=4,tp=4" in labels
    table = plan.table()
    assert "recommended:" in table and "assumption:" in table


def test_other_programs_load_slows_compute_down() -> None:
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    two = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e9), Link(0, 1e9), cores=2)
    idle = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t", share=1.0, load=3.0)
    busy = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t", share=2 / 3)
    rows = [
        estimate(
            Layout("ddp", dp=2),
            p,
            layers=layers,
            tp_plan=None,
            compute=c,
            comm=CommModel(default=Link(0, 1e12)),
            hw=two,
            overlap=0.0,
        )
        for c in (idle, busy)
    ]
    # A third of a core lost: the calibration shared 2 cores with 2 other threads, so
    # 2 ranks + 2 others on 2 cores. A load average alone (idle: 3.0) is not evidence.
    assert rows[0].time.slowdown == 1.0 and rows[1].time.slowdown == pytest.approx(2.0)
    assert rows[1].time.cpu == pytest.approx(rows[0].time.cpu)


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _deep_rows(compute: Compute, hw: Hardware, comm: CommModel | None = None) -> dict[str, Any]:
    p = profile_model(_deep, (torch.randn(8, 8), torch.randn(8, 8)), nn.functional.mse_loss, _adam)
    with torch.device("meta"):
        layers = list_layers(_deep())
    out = {}
    for layout in (
        Layout("pipeline", pp=4, schedule="1f1b", microbatches=4),
        Layout("pipeline", pp=2, schedule="1f1b", microbatches=4),
        Layout("ddp x pp", dp=2, pp=2, schedule="1f1b", microbatches=4),
        Layout("ddp", dp=4),
    ):
        out[layout.label] = estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute,
            comm=comm or CommModel(default=Link(0, 1e12)), hw=hw, overlap=0.0,
        ).time  # fmt: skip
    return out


def test_a_pipelines_step_is_its_schedule_simulated_on_the_cores() -> None:
    # 4 equal stages of 4 microbatches on 2 cores take turns for them as the schedule
    # fills and drains the pipeline: the row is the simulated step (plan/schedule.py),
    # each stage's forward and backward its measured share of the model's.
    from scaletrain.plan.layertime import LOSS
    from scaletrain.plan.schedule import simulate

    shares = {str(i): (0.25 / 3, 0.5 / 3) for i in range(4)} | {LOSS: (0.0, 0.0)}
    compute = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t", layer_shares=shares)
    two = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e12), Link(0, 1e12), cores=2)
    rows = _deep_rows(compute, two)
    unit = 0.01 * 8 / 4  # the model's forward and backward of one microbatch of 2
    expected = simulate([unit / 12] * 4, [unit / 6] * 4, schedule="1f1b", microbatches=4, cores=2)
    four = rows["pipeline pp=4 1f1b m=4"]
    assert four.compute + four.bubble == pytest.approx(expected.makespan)
    assert four.slowdown == pytest.approx(expected.running[0] / expected.work[0])
    assert four.slowdown > 1  # 4 stages on 2 cores: turns while all 4 are at work
    # Never more stages at work than the cores: no turns, the textbook bubble.
    two_stages = rows["pipeline pp=2 1f1b m=4"]
    assert two_stages.slowdown == pytest.approx(1.0)
    assert two_stages.bubble == pytest.approx(unit / 2)  # (pp-1) microbatches of a stage
    # Two replicas of 2 stages share the 2 cores; DDP's 4 ranks take turns all along.
    assert rows["ddp x pp dp=2,pp=2 1f1b m=4"].slowdown > 1
    assert rows["ddp dp=4"].slowdown == 2.0


def test_a_pipelines_stages_are_their_measured_shares_not_their_flops() -> None:
    # The ConvNet's first two layers hold 99.5% of its FLOPs, but BatchNorm, ReLU and
    # pooling cost time no FLOP counter sees: the calibration times each layer, and a
    # stage takes what its layers took.
    from scaletrain.plan.layertime import LOSS

    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e12), Link(0, 1e12), cores=2)
    by_flops = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t")
    lopsided = {"0": (0.5, 0.38), "1": (0.02, 0.02), "2": (0.02, 0.02), "3": (0.02, 0.02)}
    measured = replace(by_flops, layer_shares=lopsided | {LOSS: (0.0, 0.0)})
    even = _deep_rows(by_flops, cpu)["pipeline pp=2 1f1b m=4"]
    skewed = _deep_rows(measured, cpu)["pipeline pp=2 1f1b m=4"]
    unit = 0.01 * 8 / 4
    # Equal layers by FLOPs: about half the model a stage (the first layer computes no
    # gradient for the data, so the second stage holds a little more). Measured: the
    # first holds 0.92.
    assert 0.5 * 4 * unit < even.compute < 0.6 * 4 * unit
    assert skewed.compute == pytest.approx(4 * unit * 0.92)
    # Shares that miss a layer (another cut of the model): FLOPs again.
    partial_shares = replace(by_flops, layer_shares={"0": (0.5, 0.5)})
    assert _deep_rows(partial_shares, cpu)["pipeline pp=2 1f1b m=4"].compute == pytest.approx(
        even.compute
    )


def test_a_pipeline_pays_its_sends_here_and_its_loss_broadcast_is_no_meeting() -> None:
    # Each microbatch crosses every boundary twice (activations, their gradients), and
    # every step ends in the strategy's broadcast of the loss: on this machine a stage
    # pays the probe's CPU per send or receive. The broadcast is no meeting of busy
    # ranks: the first rank ends its schedule last, the others already in it.
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e12), Link(0, 1e12), cores=2)
    compute = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t")
    quiet = CommModel(default=Link(0, 1e15))
    paid = CommModel(default=Link(0, 1e15), send_cpu={2: 0.001}, meeting={2: 0.004})
    base = _deep_rows(compute, cpu, quiet)["pipeline pp=2 1f1b m=4"]
    sends = _deep_rows(compute, cpu, paid)["pipeline pp=2 1f1b m=4"]
    # The busiest stage: one boundary, 4 microbatches, a send and a receive each.
    assert sends.compute == pytest.approx(base.compute + 4 * 2 * 0.001)
    assert sends.wait == pytest.approx(base.wait)
    # On a profile (GPUs): neither.
    gpu = PROFILES["h100-sxm"]
    assert _deep_rows(compute, gpu, paid)["pipeline pp=2 1f1b m=4"].total == pytest.approx(
        _deep_rows(compute, gpu, quiet)["pipeline pp=2 1f1b m=4"].total
    )


def test_a_pipelines_hops_are_the_probes_stage_hops_here() -> None:
    # On this machine a pipeline's sends are priced as the probe timed a stage's (the
    # sender going on with its work, the other ranks computing), at the row's group
    # size; a row of another size keeps the send's link, and a profile (GPUs) its own.
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e12), Link(0, 1e12), cores=2)
    compute = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t")
    quiet = CommModel(default=Link(1e-4, 1e15))
    late = CommModel(default=Link(1e-4, 1e15), stage_hop={4: Link(0.005, 1e15)})
    four = "pipeline pp=4 1f1b m=4"
    base = _deep_rows(compute, cpu, quiet)[four]
    slow = _deep_rows(compute, cpu, late)[four]
    # The chain through 4 stages and back has 6 hops on its path at least.
    assert slow.total > base.total + 6 * (0.005 - 1e-4) * 0.99
    assert slow.compute == pytest.approx(base.compute)  # waiting, not work
    two = "pipeline pp=2 1f1b m=4"
    assert _deep_rows(compute, cpu, late)[two].total == pytest.approx(
        _deep_rows(compute, cpu, quiet)[two].total
    )
    gpu = PROFILES["h100-sxm"]
    assert _deep_rows(compute, gpu, late)[four].total == pytest.approx(
        _deep_rows(compute, gpu, quiet)[four].total
    )
    # The plan says what it took a hop to cost, beside a quiet send's.
    from scaletrain.plan.api import plan_model

    def said(comm: CommModel) -> list[str]:
        known = replace(compute, overhead={"step": 0.0, "pipeline": 0.0}, trace_bytes=1)
        return plan_model(
            _deep, lambda b: (torch.randn(b, 8), torch.randn(b, 8)),
            loss_fn=nn.functional.mse_loss, optimizer=_adam, batch_size=8, devices=2,
            layouts=[Layout("pipeline", pp=2, schedule="1f1b", microbatches=2)],
            compute=known, comm=comm, device="cpu",
        ).assumptions  # fmt: skip

    hop = CommModel(default=Link(1e-4, 1e15), stage_hop={2: Link(0.003, 1e15)})
    assert any("hop of" in a and "3.00 ms as a stage makes it" in a and "0.10 ms quiet" in a
               for a in said(hop))  # fmt: skip
    assert not any("as a stage makes it" in a for a in said(quiet))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_probe_times_a_stage_hop_while_the_other_ranks_compute() -> None:
    # 3 ranks: the third computes until the pair is done, then all go on (no rank
    # left waiting: the probe returns).
    from scaletrain.plan.comm import collective_time
    from scaletrain.plan.probe import probe

    comm = probe(3, [4096, 65536], hop_sizes=[65536])
    # Timed by the receiver on the sender's clock: a real latency, not a sign error
    # (negative, clamped to 0) or a stale stamp (seconds).
    took = collective_time("send", 65536, 2, comm.stage_hop[3])
    assert 1e-6 < took < 1.0 and ("send", 3) in comm.links


def test_a_small_child_of_a_large_parent_reports_its_own_peak_rss() -> None:
    # ru_maxrss would report the parent's RSS at the fork (Linux keeps it across exec);
    # the ledger's and the planner's peak is VmHWM, the child's own.
    import subprocess
    import sys

    from scaletrain.observe.memory import current_rss_bytes

    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page
    parent = current_rss_bytes()
    code = "from scaletrain.observe.memory import rss_peak_bytes; print(rss_peak_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)  # fmt: skip
    del ballast
    assert parent is not None and child < parent - 300 * 2**20


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _wide_example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 64), torch.randint(0, 64, (b,))


def test_strategy_machinery_is_measured_on_the_model() -> None:
    from scaletrain.plan.overhead import measure_overheads

    found = measure_overheads(
        _wide, _wide_example(4), nn.functional.cross_entropy, _adam,
        tp_plan={"0": "colwise", "2": "rowwise"}, layers=["0", "2"], repeats=3,
    )  # fmt: skip
    assert found is not None and set(found) == {"ddp", "tensor", "fsdp"}
    # DTensor dispatch on every op of 2 Linears and their optimizer step: far more than
    # the microseconds of FLOPs of a 4-sample batch.
    assert found["tensor"] > 1e-4 and found["fsdp"] > 1e-4  # DDP's too, ~1 ms on the recipes
    import torch.distributed as dist

    assert not dist.is_initialized()  # its one-rank group is gone


def test_measured_machinery_is_added_to_its_own_rows_only() -> None:
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    base = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")
    costly = Compute(
        fixed=0.0, per_sample=0.001, optimizer=0.0, source="t",
        overhead={"tensor": 0.05, "fsdp": 0.02, "ddp": 0.01},
    )  # fmt: skip
    free = CommModel(default=Link(0, 1e15))

    def total(layout: Layout, compute: Compute) -> float:
        row = estimate(
            layout, p, layers=layers, tp_plan={"0": "colwise", "2": "rowwise"},
            compute=compute, comm=free, hw=PROFILES["h100-sxm"], overlap=0.0,
        )  # fmt: skip
        return row.time.total

    for layout, extra in (
        (Layout("ddp", dp=1), 0.0),  # one process: nothing wraps the model
        (Layout("ddp", dp=2), 0.01),
        (Layout("fsdp", dp=2), 0.02),
        (Layout("tensor", tp=2), 0.05),
        (Layout("fsdp x tp", dp=2, tp=2), 0.07),
    ):
        assert total(layout, costly) - total(layout, base) == pytest.approx(extra)
    # A pipeline's machinery, measured for the whole model as one stage: a stage pays
    # its share of it (its share of the FLOPs).
    piped = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t",
                    overhead={"pipeline": 0.04})  # fmt: skip
    stage = Layout("pipeline", pp=2, schedule="1f1b", microbatches=2)
    extra = total(stage, piped) - total(stage, base)
    assert 0.02 <= extra < 0.04  # the busiest of 2 stages: at least half
    assert total(Layout("ddp", dp=2), piped) == pytest.approx(total(Layout("ddp", dp=2), base))


def test_the_pipeline_machinery_is_measured_as_one_stage() -> None:
    from scaletrain.plan.overhead import measure_overheads

    found = measure_overheads(
        _wide, _wide_example(8), nn.functional.cross_entropy, _adam,
        tp_plan=None, layers=["0", "2"], microbatches=4, repeats=3,
    )  # fmt: skip
    assert found is not None and set(found) == {"ddp", "fsdp", "pipeline"}
    # The traced graph and the 1F1B schedule over 4 microbatches, against the plain
    # model over the same 4 microbatches (~2 ms here; its size is a timing, which CI's
    # load can drown at 3 repeats: only that it was measured is asserted).
    assert found["pipeline"] >= 0.0
    # Microbatches that do not divide the batch: not measured (the strategy refuses).
    odd = measure_overheads(
        _wide, _wide_example(6), nn.functional.cross_entropy, _adam,
        tp_plan=None, layers=["0", "2"], microbatches=4, repeats=1,
    )  # fmt: skip
    assert odd is not None and "pipeline" not in odd


def test_a_slowest_rank_is_the_median_of_the_maximum() -> None:
    from scaletrain.plan.comm import Concurrency

    even = Concurrency(ranks=2, factor=1.0, spread=tuple(0.5 + i / 100 for i in range(101)))
    assert even.sync(1) == 1.0  # one rank waits for no one
    # The maximum of n draws is below v with probability F(v)^n: its median is the
    # 0.5^(1/n) quantile (0.707 of the way for 2, 0.841 for 4).
    assert even.sync(2) == pytest.approx(0.5 + 0.5**0.5, abs=0.011)
    assert even.sync(4) == pytest.approx(0.5 + 0.5**0.25, abs=0.011)
    assert Concurrency(ranks=2, factor=1.0, spread=(1.0, 1.0, 1.0)).sync(8) == 1.0
    assert Concurrency(ranks=2, factor=1.0, spread=()).sync(8) == 1.0
    # Ranks of equal work, named: the same.
    assert even.sync(2, [1.0, 1.0]) == pytest.approx(even.sync(2))
    assert even.sync(4, [0.5, 0.5, 0.5, 0.5]) == pytest.approx(even.sync(4))


def test_a_rank_with_less_work_makes_the_busiest_wait_less() -> None:
    from scaletrain.plan.comm import Concurrency

    even = Concurrency(ranks=2, factor=1.0, spread=tuple(0.5 + i / 100 for i in range(101)))
    # A rank with 40% of the busiest's work never outlasts it (at most 1.5 x 0.4 = 0.6,
    # where the busiest's median is 1): the busiest waits for no one, its median is 1.
    assert even.sync(2, [1.0, 0.4]) == pytest.approx(1.0, abs=1e-6)
    # At 80%: below v with probability F(v) x F(v / 0.8), between the two.
    mixed = even.sync(2, [1.0, 0.8])
    assert 1.0 < mixed < even.sync(2)
    f = lambda v: min(1.0, max(0.0, v - 0.5))  # noqa: E731 (the spread's CDF)
    assert f(mixed) * f(mixed / 0.8) == pytest.approx(0.5, abs=1e-6)
    # The order of the ranks does not matter; weights over any busiest are normalised.
    assert even.sync(2, [0.8, 1.0]) == pytest.approx(mixed)
    assert even.sync(2, [2.0, 1.6]) == pytest.approx(mixed)
    # Weights a hair off equal: the bisection agrees with the closed form.
    assert even.sync(3, [1.0, 1.0, 1.0 - 1e-9]) == pytest.approx(even.sync(3), abs=1e-6)
    # One weight per rank, or an error (before, the weights' count silently won).
    with pytest.raises(ValueError, match="2 weights for 4 ranks"):
        even.sync(4, [1.0, 0.99])


def test_side_by_side_costs_count_on_this_machine_only() -> None:
    from scaletrain.plan.comm import Concurrency

    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e15), Link(0, 1e15), cores=2)
    side = Concurrency(ranks=2, factor=1.25, spread=(0.9, 1.0, 1.0, 1.2, 1.4))
    quiet = CommModel(default=Link(0, 1e15))
    measured = CommModel(default=Link(0, 1e15), meeting={2: 0.003}, concurrency={2: side})

    def time(layout: Layout, comm: CommModel, hw: Hardware) -> Any:
        return estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute, comm=comm, hw=hw,
            overlap=0.0,
        ).time  # fmt: skip

    ddp = Layout("ddp", dp=2)
    base, busy = time(ddp, quiet, cpu), time(ddp, measured, cpu)
    # Ranks side by side: 1.25x the CPU; waiting for the slowest of 2 (spread's 0.707
    # quantile: 1.2 + 0.83 x 0.2); one blocking all-reduce at 3 ms.
    assert busy.compute == pytest.approx(base.compute * 1.25)
    assert busy.wait == pytest.approx(busy.compute * (side.sync(2) - 1) + 0.003)
    assert busy.exposed == pytest.approx(base.exposed)  # waiting, not communication
    assert busy.total == pytest.approx(busy.compute + busy.exposed + busy.wait)
    assert busy.cpu == pytest.approx(busy.compute + busy.exposed)  # and not CPU either
    # FSDP meets three times per unit (two all-gathers and a reduce-scatter).
    fsdp = time(Layout("fsdp", dp=2), measured, cpu)
    meetings = fsdp.wait - fsdp.compute * (side.sync(2) - 1)
    assert meetings == pytest.approx(3 * len(layers) * 0.003)
    # A pipeline's sends are posted ahead (a stage waits at a receive for the data
    # only, the bubble), and its loss's broadcast at the step's end is no meeting (the
    # first rank ends its schedule last, the others waiting in it): the slowest rank's
    # wait only, as much as the other stage's work can outlast the busiest's.
    layout = Layout("pipeline", pp=2, schedule="1f1b", microbatches=4)

    def piped(first: tuple[float, float], last: tuple[float, float]) -> Any:
        shares = {"0": first, "2": last}  # each stage's share of the model's step
        return estimate(
            layout, p, layers=layers, tp_plan=None, comm=measured, hw=cpu, overlap=0.0,
            compute=replace(compute, layer_shares=shares),
        ).time  # fmt: skip

    # Equal stages: the slowest of 2.
    equal = piped((0.25, 0.25), (0.25, 0.25))
    assert equal.wait == pytest.approx((equal.compute + equal.bubble) * (side.sync(2) - 1))
    assert equal.wait > 0.0
    # A last stage with a twentieth of the first's work never outlasts it (1.4 x its
    # share of the busiest's is below the spread's 0.9): no wait.
    lopsided = piped((0.38, 0.57), (0.02, 0.03))
    assert lopsided.wait == pytest.approx(0.0, abs=1e-9)
    # Two replicas of that pipeline (ddp x pp over 4): each first stage is a busiest
    # rank, so the step waits for the slower of those 2, the light stages for no one.
    four = replace(measured, concurrency={4: side})
    replicas = estimate(
        Layout("ddp x pp", dp=2, pp=2, schedule="1f1b", microbatches=4), p, layers=layers,
        tp_plan=None, comm=four, hw=cpu, overlap=0.0,
        compute=replace(compute, layer_shares={"0": (0.38, 0.57), "2": (0.02, 0.03)}),
    ).time  # fmt: skip
    assert replicas.wait == pytest.approx((replicas.compute + replicas.bubble) * (side.sync(2) - 1))
    assert replicas.wait > 0.0
    # On a profile (GPUs: the collectives run on the devices' own engines) not counted.
    gpu = PROFILES["h100-sxm"]
    assert time(ddp, measured, gpu).total == pytest.approx(time(ddp, quiet, gpu).total)


def test_fsdp_and_tensor_rows_here_work_as_long_as_the_probe_measured_their_steps() -> None:
    # Where ranks outnumber cores, DTensor's dispatch runs on caches left cold at every
    # collective (the gpt recipe at 4 ranks on 2 cores: 51-60 ms of CPU a step, its
    # work alone 31-34): the probe times the tensor-parallel step among the ranks, and
    # the row's work is that (its seconds at the probe's batch, scaled as the
    # calibration's step to the row's), not the count times the contention.
    from scaletrain.plan.comm import Concurrency
    from scaletrain.plan.estimate import step_collectives

    p = profile_model(_sharded_model, _sharded_example(4), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_sharded_model())
    tp_plan = {"0": "colwise", "2": "rowwise"}
    # A rowwise layer's output forward, a colwise one's input gradient backward.
    assert step_collectives(p, layers, tp_plan, None)["tensor"] == [
        ("all_reduce", 4 * 512 * 4), ("all_reduce", 4 * 512 * 4),
    ]  # fmt: skip
    compute = Compute(fixed=0.01, per_sample=0.001, optimizer=0.004, source="t",
                      overhead={"step": 0.002, "tensor": 0.003})  # fmt: skip
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e15), Link(0, 1e15), cores=2)
    side = Concurrency(ranks=2, factor=1.25, spread=(1.0,))
    counted = CommModel(default=Link(0, 1e15), concurrency={4: side})
    measured = replace(counted, step_cpu={("tensor", 4): 0.027}, batch=4)

    def time(layout: Layout, comm: CommModel, hw: Hardware = cpu) -> Any:
        return estimate(
            layout, p, layers=layers, tp_plan=tp_plan, compute=compute, comm=comm, hw=hw,
            overlap=0.0,
        ).time  # fmt: skip

    tensor = Layout("tensor", tp=4)
    # 4 ranks on 2 cores take turns (x2): the 0.027 s measured, and the runtime's step
    # around it; no contention on top.
    assert time(tensor, measured).compute == pytest.approx((0.027 + 0.002) * 2)
    # Measured at 2 samples a rank: x the calibration's step at 4 over its step at 2
    # ((0.01 + 0.004 + 0.004) / (0.01 + 0.002 + 0.004)).
    halved = replace(measured, batch=2)
    assert time(tensor, halved).compute == pytest.approx((0.027 * 18 / 16 + 0.002) * 2)
    # ... from the calibration's line, not a size's own time (a pipeline's microbatch).
    levelled = replace(compute, levels={2: 0.5})
    assert estimate(
        tensor, p, layers=layers, tp_plan=tp_plan, compute=levelled, comm=halved, hw=cpu,
        overlap=0.0,
    ).time.compute == pytest.approx((0.027 * 18 / 16 + 0.002) * 2)  # fmt: skip
    # With no batch given (a CommModel built by hand): at the row's.
    assert time(tensor, replace(measured, batch=None)).compute == pytest.approx((0.027 + 0.002) * 2)
    assert time(tensor, counted).compute != pytest.approx(time(tensor, measured).compute)
    # Only where measured: another degree, other strategies and a profile are as before.
    assert time(Layout("tensor", tp=2), measured).total == pytest.approx(
        time(Layout("tensor", tp=2), counted).total
    )
    for other in (Layout("ddp", dp=4), Layout("fsdp x tp", dp=2, tp=2), Layout("fsdp", dp=4)):
        assert time(other, measured).total == pytest.approx(time(other, counted).total)
    gpu = PROFILES["h100-sxm"]
    assert time(tensor, measured, gpu).total == pytest.approx(time(tensor, counted, gpu).total)
    # FSDP's likewise (its copies and hooks around each unit), for its own row.
    sharded = replace(counted, step_cpu={("fsdp", 4): 0.0216}, batch=4)
    fsdp = Layout("fsdp", dp=4)
    assert time(fsdp, sharded).compute == pytest.approx((0.0216 + 0.002) * 2)
    assert time(tensor, sharded).total == pytest.approx(time(tensor, counted).total)


class _Blocks(nn.Module):
    """Two blocks in a container (FSDP's units) and a head on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Gained(_Blocks):
    """_Blocks with a parameter of the root's own (in no layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def test_an_fsdp_rows_collectives_are_the_strategys_units_and_its_root() -> None:
    # FSDP gathers each unit for its forward and again for its backward and reduces it
    # once; the root (what no unit holds) is gathered once, kept to its backward. The
    # gpt recipe's 4 blocks and root: 9 all-gathers and 5 reduce-scatters a step,
    # counted in a run; priced as the planner's 8 layers they were 16 and 8.
    from scaletrain.train.planning import fsdp_units_of

    p = profile_model(_Blocks, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_Blocks())
    units = fsdp_units_of(_Blocks)
    assert units == ["blocks.0", "blocks.1"]
    # Latency only: an all-gather 1 s, a reduce-scatter 10 s per message (1 of each at 2).
    comm = CommModel(links={
        ("all_gather", 2): Link(1.0, 1e30), ("reduce_scatter", 2): Link(10.0, 1e30),
    })  # fmt: skip
    compute = Compute(fixed=0.0, per_sample=0.0, optimizer=0.0, source="t")

    def row(names: list[str] | None) -> Any:
        return estimate(
            Layout("fsdp", dp=2), p, layers=layers, tp_plan=None, compute=compute,
            comm=comm, hw=PROFILES["h100-sxm"], overlap=0.0, fsdp_units=names,
        )  # fmt: skip

    assert row(units).time.comm == pytest.approx(2 * (2 * 1.0 + 10.0) + (1.0 + 10.0))
    # Without the strategy's units, each of the planner's layers is one (as before).
    assert row(None).time.comm == pytest.approx(len(layers) * (2 * 1.0 + 10.0))
    # ... and the root, where it holds parameters of its own, as the probe wraps them.
    p2 = profile_model(_Gained, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        gained = list_layers(_Gained())
    assert [x.name for x in gained] == [x.name for x in layers]
    loose = estimate(
        Layout("fsdp", dp=2), p2, layers=gained, tp_plan=None, compute=compute, comm=comm,
        hw=PROFILES["h100-sxm"], overlap=0.0,
    )  # fmt: skip
    assert loose.time.comm == pytest.approx(len(layers) * (2 * 1.0 + 10.0) + (1.0 + 10.0))
    # No containers: the whole model is the root, gathered once.
    assert row([]).time.comm == pytest.approx(1.0 + 10.0)
    # The two largest units' gathered parameters (one in use, the next prefetched) and
    # the largest again for its gradients: the blocks (8 x 8 + 8 each), not the root's
    # head (8 x 4 + 4).
    assert row(units).memory.buffers == 3 * 72 * 4
    assert row([]).memory.buffers == 2 * (2 * 72 + 36) * 4  # one unit: the whole model


def test_collectives_here_cost_what_the_probe_timed_as_a_step_reaches_them() -> None:
    # On this machine a step's collectives are reached from work (every core busy up to
    # them): the probe times them so, and DDP's buckets, FSDP's gathers and reductions
    # and tensor parallel's all-reduces cost that, with no meeting cost on top; where it
    # did not (another group size) or on a profile, quiet plus a meeting as before.
    p = profile_model(_Blocks, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_Blocks())
    compute = Compute(fixed=0.0, per_sample=0.0, optimizer=0.0, source="t")
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e30), Link(0, 1e30), cores=2)
    busy = {
        ("all_reduce", 2): Link(1.0, 1e30),
        ("all_gather", 2): Link(10.0, 1e30),
        ("reduce_scatter", 2): Link(100.0, 1e30),
    }
    quiet = CommModel(default=Link(0.0, 1e30), meeting={2: 0.001, 4: 0.001})
    measured = replace(quiet, busy=busy)
    tp_plan = {"blocks.0.0": "colwise", "blocks.1.0": "rowwise"}

    def time(layout: Layout, comm: CommModel, hw: Hardware = cpu) -> Any:
        return estimate(
            layout, p, layers=layers, tp_plan=tp_plan, compute=compute, comm=comm, hw=hw,
            overlap=0.0, fsdp_units=["blocks.0", "blocks.1"],
        ).time  # fmt: skip

    ar = collective_time("all_reduce", 1, 2, busy[("all_reduce", 2)])  # 2 messages at 2
    ddp = time(Layout("ddp", dp=2), measured)
    assert ddp.exposed == pytest.approx(ar) and ddp.wait == 0.0  # one bucket, no buffers
    fsdp = time(Layout("fsdp", dp=2), measured)
    # 2 units gathered twice, the root once; 3 reduced: one message each at 2.
    assert fsdp.exposed == pytest.approx(5 * 10.0 + 3 * 100.0) and fsdp.wait == 0.0
    tensor = time(Layout("tensor", tp=2), measured)
    assert tensor.exposed == pytest.approx(2 * ar) and tensor.wait == 0.0
    # Not probed at this group size (4 devices, FSDP over 2 of them), or a profile:
    # quiet (0 here), and each a meeting.
    mixed = time(Layout("fsdp x tp", dp=2, tp=2), replace(measured, busy={}))
    assert mixed.exposed == pytest.approx(0.0) and mixed.wait == pytest.approx(
        0.001 * 8 + 0.001 * 2
    )
    assert time(Layout("fsdp x tp", dp=2, tp=2), measured).total == pytest.approx(mixed.total)
    gpu = PROFILES["h100-sxm"]
    for layout in (Layout("ddp", dp=2), Layout("fsdp", dp=2), Layout("tensor", tp=2)):
        assert time(layout, measured, gpu).total == pytest.approx(time(layout, quiet, gpu).total)
        assert time(layout, quiet).wait > 0  # measured quiet here: each a meeting


def test_an_fsdp_row_grows_at_least_what_the_probe_measured_of_its_steps() -> None:
    # On a CPU the allocator keeps much of what FSDP frees at every unit (the gpt
    # recipe's sharded runs grew 10 MiB more than DDP's, holding half its optimizer
    # state): the probe measures the model's sharded steps, and the row holds that.
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t", runtime_bytes=7)
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e15), Link(0, 1e15), cores=2)
    big = 64 * 2**20

    def memory(
        layout: Layout, measured: int | None, hw: Hardware = cpu, strategy: str = "fsdp"
    ) -> Any:
        comm = CommModel(default=Link(0, 1e15))
        if measured is not None:
            comm.step_growth[(strategy, 2)] = measured
        return estimate(
            layout, p, layers=layers, tp_plan={"0": "colwise", "2": "rowwise"},
            compute=compute, comm=comm, hw=hw, overlap=0.0,
        ).memory  # fmt: skip

    fsdp = Layout("fsdp", dp=2)
    modelled = memory(fsdp, None)
    assert modelled.held == 0
    held = memory(fsdp, big)
    assert held.growth == big and held.total == modelled.total + big - modelled.growth
    # Never below the model of it, and only the measured layout, on this machine.
    assert memory(fsdp, 1).growth == modelled.growth
    assert memory(Layout("ddp", dp=2), big).held == 0
    assert memory(Layout("fsdp", dp=4), big).held == 0
    assert memory(Layout("fsdp x tp", dp=2, tp=2), big).held == 0
    assert memory(fsdp, big, PROFILES["h100-sxm"]).held == 0
    # Tensor parallel's steps likewise (the gpt recipe's at 4 ranks grew 37-39 MiB in
    # the probe's and in its runs, where its tensors made 32), for its own row only.
    tensor = Layout("tensor", tp=2)
    assert memory(tensor, big, strategy="tensor").growth == big
    assert memory(tensor, big).held == 0 and memory(fsdp, big, strategy="tensor").held == 0
    assert memory(tensor, big, PROFILES["h100-sxm"], strategy="tensor").held == 0


def test_a_plan_says_when_fsdps_steps_went_unmeasured() -> None:
    from scaletrain.plan.here import _say_side_by_side

    said: list[str] = []
    _say_side_by_side(CommModel(), 2, said, sharded=True)
    assert any(a.startswith("FSDP's steps not measured") for a in said), said
    quiet: list[str] = []
    _say_side_by_side(CommModel(step_growth={("fsdp", 2): 2**20}), 2, quiet, sharded=True)
    assert any("grew RSS by 1.0 MiB" in a for a in quiet), quiet
    tensored: list[str] = []
    _say_side_by_side(CommModel(step_growth={("tensor", 2): 3 * 2**20}), 2, tensored)
    assert any(a.startswith("tensor parallel's steps over 2 ranks grew RSS by 3.0 MiB")
               for a in tensored), tensored  # fmt: skip
    assert not any("not measured (the model's step did not load" in a for a in quiet)


def test_a_plan_says_what_its_collectives_cost_as_a_step_reaches_them() -> None:
    from scaletrain.plan.here import _say_side_by_side

    comm = CommModel(
        links={("all_gather", 2): Link(0.0005, 1e30)},
        busy={("all_gather", 2): Link(0.0015, 1e30)},
    )
    said: list[str] = []
    _say_side_by_side(comm, 2, said, size=2**20)
    assert any("at 1024 KiB, all-gather 1.50 ms (0.50 ms back to back)" in a for a in said), said
    quiet: list[str] = []
    _say_side_by_side(comm, 4, quiet, size=2**20)
    assert not any("as a step reaches them" in a for a in quiet), quiet


def test_a_plan_says_what_the_tensor_parallel_step_took_among_the_ranks() -> None:
    from scaletrain.plan.here import _say_side_by_side

    said: list[str] = []
    comm = CommModel(step_cpu={("tensor", 4): 0.013, ("fsdp", 4): 0.011}, batch=8)
    _say_side_by_side(comm, 4, said)
    assert any("tensor-parallel rank's work (its shards and DTensor's dispatch) among 4 ranks "
               "takes 13.0 ms of CPU a step at 8 samples" in a for a in said), said  # fmt: skip
    assert any("FSDP rank's work" in a and "11.0 ms" in a for a in said), said
    quiet: list[str] = []
    _say_side_by_side(CommModel(step_cpu={("tensor", 2): 0.013}), 4, quiet)
    assert not any("tensor-parallel" in a for a in quiet), quiet


def _sharded_model() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))


def _sharded_example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 512), torch.randint(0, 512, (b,))


def _broken() -> nn.Module:
    raise RuntimeError("this model cannot be built")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_probe_measures_ranks_side_by_side() -> None:
    from functools import partial

    from scaletrain.observe.memory import reset_rss_peak
    from scaletrain.plan.overhead import model_step, sharded_step, tensor_step
    from scaletrain.plan.probe import probe

    work = partial(model_step, _wide, _wide_example(16), nn.functional.cross_entropy, _adam)
    sharded = partial(
        sharded_step, _sharded_model, _sharded_example(4), nn.functional.cross_entropy, _adam,
        ("0", "2"),
    )  # fmt: skip
    tensored = partial(
        tensor_step, _sharded_model, _sharded_example(4), nn.functional.cross_entropy, _adam,
        {"0": "colwise", "2": "rowwise"},
    )  # fmt: skip
    collectives = {
        "tensor": [("all_reduce", 4 * 512 * 4)] * 2,
        "fsdp": [("all_gather", 2 * 2**20)] * 2 + [("reduce_scatter", 2 * 2**20)],
    }
    comm = probe(2, [4096, 65536], work=work, sharded=sharded, tensored=tensored,
                 collectives=collectives, batch=4)  # fmt: skip
    assert comm.batch == 4  # the samples per rank its steps' CPU was measured at
    assert {("all_reduce", 2), ("all_gather", 2), ("send", 2)} <= set(comm.links)
    assert 2 in comm.meeting
    # A send is timed between two ranks, not borrowed from the all-gather; what a send
    # or a receive costs its process in CPU is measured with it.
    assert comm.links[("send", 2)] is not comm.links[("all_gather", 2)]
    assert comm.send_cpu[2] > 0
    # No pipeline's sends given: no stage hop timed (the probe's time is the plan's).
    assert not comm.stage_hop
    # Adam's two moments of a rank's half of the 4 MiB model at least (where RSS can
    # be read: no measurement elsewhere).
    if reset_rss_peak():
        assert comm.step_growth[("fsdp", 2)] >= 4 * 2**20
        # Tensor parallel's likewise, measured in ranks of its own.
        assert comm.step_growth[("tensor", 2)] >= 4 * 2**20
    side = comm.concurrency[2]
    assert side.ranks == 2 and side.factor < 3
    # 2 ranks x 2 turns x at least 5 steps, each over its turn's median.
    assert len(side.spread) >= 20 and list(side.spread) == sorted(side.spread)
    assert side.spread[len(side.spread) // 2] == pytest.approx(1.0, rel=0.2)
    # The tensor-parallel and fully sharded steps' CPU, both ranks stepping: a real
    # share of the plain step's alone (a 4 MiB model's halves, against the 16-sample
    # wide model).
    assert side.alone > 0
    assert 0.01 * side.alone < comm.step_cpu[("tensor", 2)] < 100 * side.alone
    assert 0.01 * side.alone < comm.step_cpu[("fsdp", 2)] < 100 * side.alone
    # Every collective also timed as a step reaches it (every rank from work).
    assert {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2)} <= set(comm.busy)
    # A step that cannot be sent (a lambda) or fails in the ranks: collectives and the
    # meeting cost only, and no failure (the plan goes on without it).
    for bad in (
        partial(model_step, lambda: _wide(), _wide_example(4), nn.functional.cross_entropy, _adam),
        partial(model_step, _broken, _wide_example(4), nn.functional.cross_entropy, _adam),
    ):
        bare = probe(2, [4096, 65536], work=bad, sharded=partial(sharded_step, *bad.args, ()),
                     tensored=partial(tensor_step, *bad.args, {"0": "colwise"}))  # fmt: skip
        assert 2 in bare.meeting and ("all_reduce", 2) in bare.links and not bare.concurrency
        assert not bare.step_growth and not bare.step_cpu
    # A tensor-parallel step that fails in the ranks, beside a plain step that runs: no
    # measurement of it, the rest as before.
    broken = partial(tensor_step, _broken, *tensored.args[1:])
    half = probe(2, [4096, 65536], work=work, tensored=broken, collectives=collectives)
    assert 2 in half.concurrency and not half.step_cpu


def _plan_with_fsdp(q: Any) -> None:
    from scaletrain.plan.api import plan_model

    p = plan_model(
        _sharded_model, _sharded_example, loss_fn=nn.functional.cross_entropy,
        optimizer=_adam, batch_size=4, devices=2,
        layouts=[Layout("ddp", dp=2), Layout("fsdp", dp=2)],
    )  # fmt: skip
    q.put((p.assumptions, p.row("fsdp").memory.growth, p.row("ddp").memory.held))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_plan_here_holds_what_fsdps_steps_grew() -> None:
    import multiprocessing as mp
    import re

    from scaletrain.observe.memory import reset_rss_peak
    from scaletrain.plan.probe import STRATEGY_STEPS

    # In a process of its own, as `scaletrain plan` runs: the planning process's RSS
    # is measured, and what a plan frees here would feed later tests' measurements.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_plan_with_fsdp, args=(q,))
    proc.start()
    try:
        assumptions, fsdp_growth, ddp_held = q.get(timeout=200)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if not reset_rss_peak():
        pytest.skip("no peak RSS to restart here (/proc/self/clear_refs)")
    said = [a for a in assumptions if a.startswith("FSDP's steps over 2 ranks")]
    assert said, assumptions
    found = re.search(rf"grew RSS by ([0-9.]+) MiB in {STRATEGY_STEPS} steps", said[0])
    assert found, said
    assert fsdp_growth >= (float(found[1]) - 0.05) * 2**20
    assert ddp_held == 0


def test_the_recipes_step_goes_to_the_probe_by_reference() -> None:
    import pickle
    from functools import partial

    from scaletrain.plan.overhead import model_step
    from scaletrain.train.planning import resolve_model

    for recipe in ("convnet", "gpt"):  # no lambdas: the probe's processes build the step
        _, build, example, loss, optimizer, _ = resolve_model(recipe, None)
        pickle.loads(pickle.dumps(partial(model_step, build, example(2), loss, optimizer)))


def test_calibrated_growth_holds_the_optimizer_state() -> None:
    # Adam's two moments of a 4 MiB model (8 MiB) appear at its first step; the
    # calibration's RSS growth, from which the runtime term is derived, includes them.
    from scaletrain.plan.api import calibrate

    def big() -> nn.Module:
        return nn.Linear(1024, 1024)

    def example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 1024), torch.randint(0, 1024, (b,))

    compute = calibrate(big, example, nn.functional.cross_entropy, _adam, [2, 1], repeats=1)
    if compute.measured_growth is None:
        pytest.skip("no peak RSS to restart here (/proc/self/clear_refs)")
    assert compute.measured_growth >= 8 * 2**20


def test_the_groups_own_memory_is_in_the_total_not_in_the_growth() -> None:
    # A run's first collective (at setup) allocates Gloo's transport before its RSS
    # growth is measured: runs of 2 and 4 processes grew 0-3 MiB more than 1 process.
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t", runtime_bytes=7)
    rows = {
        group: estimate(
            Layout("ddp", dp=2), p, layers=layers, tp_plan=None, compute=compute,
            comm=CommModel(default=Link(0, 1e12), runtime_bytes={2: group}),
            hw=PROFILES["h100-sxm"], overlap=0.0,
        ).memory
        for group in (0, 30 * 2**20)
    }  # fmt: skip
    assert rows[0].growth == rows[30 * 2**20].growth
    assert rows[30 * 2**20].total - rows[0].total == 30 * 2**20


def test_a_pipelines_trace_is_measured_and_counted_in_pipeline_rows_only() -> None:
    from scaletrain.observe.memory import reset_rss_peak
    from scaletrain.plan.overhead import trace_bytes

    if not reset_rss_peak():
        pytest.skip("no peak RSS to restart here (/proc/self/clear_refs)")
    # In a fresh process, as the planner measures it: in this one an earlier test's
    # export of the same model, or memory other tests freed, can leave nothing to grow.
    traced = trace_bytes(_wide, (_wide_example(2)[0],))
    assert traced is not None and traced > 0  # torch.export keeps graphs, fake tensors, code
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    compute = Compute(
        fixed=0.0, per_sample=0.001, optimizer=0.0, source="t", runtime_bytes=5, trace_bytes=1000
    )
    free = CommModel(default=Link(0, 1e15))

    def runtime(layout: Layout) -> int:
        row = estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute, comm=free,
            hw=PROFILES["h100-sxm"], overlap=0.0,
        )  # fmt: skip
        return row.memory.runtime

    assert runtime(Layout("ddp", dp=2)) == 5
    assert runtime(Layout("pipeline", pp=2, schedule="1f1b", microbatches=4)) == 1005


def test_the_machinery_is_measured_when_only_the_runtime_step_was() -> None:
    # `scaletrain plan` measures scaletrain's own step before plan_model; the tensor and
    # FSDP machinery used to be skipped then, because the overheads were not empty.
    from scaletrain.plan.api import plan_model

    step = 0.25
    known = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t", overhead={"step": step})
    plan = plan_model(
        _wide, _wide_example, loss_fn=nn.functional.cross_entropy, optimizer=_adam,
        batch_size=4, devices=2, layouts=[Layout("fsdp", dp=2)], compute=known,
        comm=CommModel(default=Link(0, 1e12)),
    )  # fmt: skip
    assert any("machinery" in a and "fsdp" in a for a in plan.assumptions)
    # ... and the runtime's step stays counted beside it (the machinery's figures used
    # to replace the overheads, dropping "step").
    assert plan.rows[0].time.compute >= step


def test_the_assumptions_say_how_the_calibration_was_scaled_and_what_else_runs() -> None:
    from scaletrain.plan.api import plan_model
    from scaletrain.plan.calibration import CALIBRATED

    def assumptions(scale: float) -> list[str]:
        known = Compute(
            fixed=0.0, per_sample=0.001, optimizer=0.0, source=CALIBRATED,
            overhead={"step": 0.001}, scale=scale, share=0.5 if scale != 1.0 else 1.0,
        )  # fmt: skip
        return plan_model(
            _mlp, _example, loss_fn=nn.functional.cross_entropy, optimizer=_adam,
            batch_size=4, devices=1, layouts=[Layout("ddp", dp=1)], compute=known,
            comm=CommModel(default=Link(0, 1e12)),
        ).assumptions  # fmt: skip

    scaled = assumptions(1.25)
    assert any("runtime's step" in a and "x1.25 to the training loop's" in a for a in scaled)
    assert not any("x1.00" in a for a in assumptions(1.0))
    # Half a core: other busy threads, said as what the share implies; a whole core:
    # no other load, not "0.0 threads".
    assert any("seem to keep about" in a and "threads busy" in a for a in scaled)
    quiet = assumptions(1.0)
    assert not any("threads busy" in a for a in quiet)
    assert any("no other load seen" in a for a in quiet)


def _normed_layers() -> nn.Module:
    # Four layers, each with a BatchNorm's buffers: a 2-stage pipeline holds half.
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(4)])


def test_a_ddp_x_pp_stage_broadcasts_its_own_buffers_not_the_whole_models() -> None:
    from scaletrain.plan.estimate import _broadcast

    p = profile_model(
        _normed_layers, (torch.randn(8, 8), torch.randn(8, 8)), nn.functional.mse_loss, _adam
    )
    with torch.device("meta"):
        layers = list_layers(_normed_layers())
    assert p.buffer_bytes and sum(p.modules[x.name].buffer_bytes for x in layers) == p.buffer_bytes
    compute = Compute(fixed=0.0, per_sample=0.0, optimizer=0.0, source="t")
    hw = PROFILES["h100-sxm"]
    slow = CommModel(default=Link(0, 1e3))  # 1 kB/s: the broadcast is the comm time

    def comm(layout: Layout) -> float:
        return estimate(
            layout, p, layers=layers, tp_plan=None, compute=compute, comm=slow, hw=hw,
            overlap=0.0,
        ).time.exposed  # fmt: skip

    both = comm(Layout("ddp x pp", dp=2, pp=2, schedule="1f1b", microbatches=2))
    alone = comm(Layout("pipeline", pp=2, schedule="1f1b", microbatches=2))
    half = _broadcast(slow, p.buffer_bytes / 2, 2, None, here=False)
    # Beyond the pipeline's own sends and its DDP's gradients: one stage's buffers.
    grads = comm(Layout("ddp", dp=2)) - _broadcast(slow, p.buffer_bytes, 2, None, here=False)
    assert both - alone - grads / 2 == pytest.approx(half, rel=0.05)

    # Buffers of no layer (registered on the model itself) are not lost: counted with
    # the largest stage's.
    def rooted() -> nn.Module:
        m = _normed_layers()
        m.register_buffer("scale", torch.ones(64))
        return m

    q = profile_model(rooted, (torch.randn(8, 8), torch.randn(8, 8)), nn.functional.mse_loss, _adam)
    assert q.buffer_bytes == p.buffer_bytes + 64 * 4
    more = estimate(
        Layout("ddp x pp", dp=2, pp=2, schedule="1f1b", microbatches=2), q, layers=layers,
        tp_plan=None, compute=compute, comm=slow, hw=hw, overlap=0.0,
    ).time.exposed  # fmt: skip
    assert more - both == pytest.approx(64 * 4 / 1e3, rel=0.05)


def test_ddp_on_gloo_holds_a_bucket_of_working_memory() -> None:
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e9), Link(0, 1e9), cores=2)
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")

    def buffers(hw: Hardware) -> int:
        row = estimate(
            Layout("ddp", dp=2), p, layers=layers, tp_plan=None, compute=compute,
            comm=CommModel(default=Link(0, 1e12)), hw=hw, overlap=0.0,
        )  # fmt: skip
        return row.memory.buffers

    assert buffers(cpu) == p.grad_bytes  # one bucket holds all of the MLP's gradients
    assert buffers(PROFILES["h100-sxm"]) == 0  # a profile (NCCL): not counted


def _normed() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def test_ddp_broadcasts_the_buffers_at_every_forward() -> None:
    # BatchNorm's running statistics go from rank 0 to the others before each forward
    # (DDP's broadcast_buffers, on by default): one more collective a step, a meeting
    # on this machine. A model without buffers has none.
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e15), Link(0, 1e15), cores=2)
    compute = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")
    comm = CommModel(default=Link(0.002, 1e15), meeting={2: 0.003})

    def time(build: Any) -> Any:
        p = profile_model(build, _example(8), nn.functional.cross_entropy, _adam)
        with torch.device("meta"):
            layers = list_layers(build())
        return estimate(
            Layout("ddp", dp=2), p, layers=layers, tp_plan=None, compute=compute, comm=comm,
            hw=cpu, overlap=0.0,
        ).time  # fmt: skip

    plain, normed = time(_mlp), time(_normed)
    # The gradients' all-reduce: 2(N-1) messages of 2 ms; the buffers' broadcast: N-1 sends.
    assert plain.exposed == pytest.approx(2 * 0.002)
    assert normed.exposed == pytest.approx(2 * 0.002 + 0.002)
    assert normed.wait - plain.wait == pytest.approx(0.003)


def _fails() -> int:
    raise RuntimeError("this calibration cannot run")


def _answer(x: int) -> int:
    return x + 1


def test_a_fresh_process_runs_a_measurement_or_says_none(tmp_path: Any) -> None:
    import importlib
    import sys
    import time

    from scaletrain.plan.overhead import in_fresh_process

    assert in_fresh_process(_answer, 41) == 42
    assert in_fresh_process(_fails) is None
    # A function the fresh process cannot load (here: its module gone from the path, as
    # a notebook's __main__ is to a spawned process) is no result, at once: a Pool
    # replaced its dead worker and waited out the whole timeout.
    (tmp_path / "vanishing.py").write_text("def answer():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        fn = importlib.import_module("vanishing").answer
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("vanishing", None)
    (tmp_path / "vanishing.py").unlink()
    t0 = time.monotonic()
    assert in_fresh_process(fn, timeout=120) is None
    assert time.monotonic() - t0 < 60


def test_the_calibration_is_the_median_of_three_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # One process's step runs 7.2-11.3 ms where another's runs the same step faster
    # (the allocator): the planner takes the median of this process and two fresh ones.
    import scaletrain.plan.overhead as overhead
    import scaletrain.train.planning as planning

    def sample(per_sample: float, growth: int | None) -> Compute:
        return Compute(
            fixed=0.0, per_sample=per_sample, optimizer=0.0, source="t", measured_growth=growth
        )

    here = sample(0.001, 30)
    fresh = iter([sample(0.003, 50), sample(0.002, None), sample(0.0015, 40)])
    monkeypatch.setattr(planning, "_calibration", lambda *a: here)
    monkeypatch.setattr(overhead, "in_fresh_process", lambda fn, *a, **k: next(fresh))
    args = (_mlp, _example, nn.functional.cross_entropy, _adam, 8, [8])
    got = planning.calibrated(*args, samples=3)
    assert got.per_sample == 0.002  # the middle of 0.001, 0.003, 0.002
    assert got.measured_growth == 40  # the median of the growths measured (30, 50)
    # A fresh process that fails is left out; of two, the mean, not the slower one.
    fresh = iter([None, sample(0.003, 50)])
    got = planning.calibrated(*args, samples=3)
    assert got.per_sample == pytest.approx(0.002) and got.measured_growth == 40
    assert got.scale == pytest.approx(2.0)  # the factor applied, as the plan reports it
    monkeypatch.setattr(overhead, "in_fresh_process", lambda fn, *a, **k: None)
    assert planning.calibrated(*args, samples=3) == here
    slow = sample(1.0, 10)
    monkeypatch.setattr(planning, "_calibration", lambda *a: slow)
    monkeypatch.setattr(overhead, "in_fresh_process", lambda fn, *a, **k: pytest.fail("ran"))
    assert planning.calibrated(*args, samples=3).per_sample == 1.0


def test_the_model_is_timed_at_the_level_of_the_real_training_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The calibration's sweep (forward and backward at each batch size, the optimizer
    # apart) ran the convnet's step 10-20% faster than a run's loop: the allocator
    # reused what the other loop freed. Its shape stays; its level is the loop's.
    import scaletrain.plan.api as api
    import scaletrain.train.planning as planning

    swept = Compute(fixed=0.002, per_sample=0.001, optimizer=0.002, source="t")
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: swept)
    # The runtime's own steps: 0.018 s each, 0.001 of it the runtime's own work.
    cost = planning.RuntimeCost(step=0.001, growth=None, whole=0.018)
    monkeypatch.setattr(planning, "runtime_overhead", lambda *a, **k: cost)
    got = planning._calibration(_mlp, _example, nn.functional.cross_entropy, _adam, 8, [8], None)
    # The sweep's step at 8 samples: 0.002 + 8 x 0.001 + 0.002 = 0.012; the loop's
    # model work 0.017: every part 17/12 of the sweep's.
    assert got.fwd_bwd(8) + got.optimizer + got.overhead["step"] == pytest.approx(0.018)
    assert got.fixed / got.per_sample == pytest.approx(2.0)
    assert got.optimizer == pytest.approx(0.002 * 17 / 12)
    assert got.scale == pytest.approx(17 / 12)  # and the plan says so (below)
    # Without the loop's figure (inside a process group): the sweep as it is.
    monkeypatch.setattr(planning, "runtime_overhead", lambda *a, **k: None)
    assert (
        planning._calibration(_mlp, _example, nn.functional.cross_entropy, _adam, 8, [8], None)
        == swept
    )


def test_a_microbatch_is_timed_as_the_calibration_timed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process's loop at the convnet recipe's batch of 32 ran 0.84-1.44x the
    # calibration's timed step (where its allocations fell), while the same process's
    # step at a pipeline's microbatch of 8 ran 2.0-2.2 ms in all 8 processes: scaled
    # to the batch's loop, the microbatch read 1.7-3.0 ms, and the pipeline's row with
    # it 11.2-16.0 ms where its runs took 11.1-11.7. A pipeline's microbatches are the
    # calibration's own, unscaled.
    import scaletrain.plan.api as api
    import scaletrain.train.planning as planning

    # The sweep's points: 0.010 at 8 samples, 0.0045 at 2 (its line, through 8 and 2
    # were fixed not 0: 0.002 + 0.001 per sample, 0.004 at 2).
    swept = Compute(fixed=0.002, per_sample=0.001, optimizer=0.002, source="t",
                    levels={8: 0.010, 2: 0.0045})  # fmt: skip
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: swept)
    cost = planning.RuntimeCost(step=0.001, growth=None, whole=0.018)
    monkeypatch.setattr(planning, "runtime_overhead", lambda *a, **k: cost)
    got = planning._calibration(
        _mlp, _example, nn.functional.cross_entropy, _adam, 8, [8, 2], None
    )  # fmt: skip
    # The batch: the sweep scaled to its loop (17/12, as above); the microbatch: the
    # sweep's own 0.0045, not that x 17/12, nor the line's.
    assert got.fwd_bwd(8) + got.optimizer + got.overhead["step"] == pytest.approx(0.018)
    assert got.levels == {2: 0.0045} and got.fwd_bwd(2) == 0.0045
    assert got.fwd_bwd(2.0) == got.fwd_bwd(2)  # a batch divided by microbatches
    assert got.fwd_bwd(4) == pytest.approx((0.002 + 4 * 0.001) * 17 / 12)  # no pipeline's
    assert got.line(2) == pytest.approx((0.002 + 2 * 0.001) * 17 / 12)
    # The batch's own point off the line (a fit that set a negative fixed to 0): the
    # loop's level still holds at the batch, the line scaled to it.
    off = replace(swept, levels={8: 0.012, 2: 0.0045})
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: off)
    got = planning._calibration(
        _mlp, _example, nn.functional.cross_entropy, _adam, 8, [8, 2], None
    )  # fmt: skip
    assert got.fwd_bwd(8) + got.optimizer + got.overhead["step"] == pytest.approx(0.018)
    # The real calibration on this CPU keeps each size's own time, the middle one too
    # (a line through the ends would read it off).
    from scaletrain.plan.calibration import calibrate

    real = calibrate(_mlp, _example, nn.functional.cross_entropy, _adam, [8, 4, 2], repeats=2)
    assert set(real.levels) == {8, 4, 2} and all(t > 0 for t in real.levels.values())
    assert real.fwd_bwd(4) == real.levels[4]
    # A pipeline's row times its microbatches (8 samples in 4: 2 each) at that level.
    p = profile_model(_mlp, _example(8), nn.functional.cross_entropy, _adam)
    with torch.device("meta"):
        layers = list_layers(_mlp())
    lined = Compute(fixed=0.0, per_sample=0.001, optimizer=0.0, source="t")
    levelled = replace(lined, levels={2: 0.004})  # the line's 0.002, twice

    def total(compute: Compute) -> float:
        row = estimate(
            Layout("pipeline", pp=2, schedule="gpipe", microbatches=4), p, layers=layers,
            tp_plan=None, compute=compute, comm=CommModel(default=Link(0, 1e15)),
            hw=PROFILES["h100-sxm"], overlap=0.0,
        )  # fmt: skip
        return row.time.total

    assert total(levelled) == pytest.approx(2 * total(lined))
    # Of two middle calibrations (a fresh process failed), the levels' mean.
    import scaletrain.plan.overhead as overhead

    low = replace(swept, levels={2: 0.002})
    high = replace(swept, per_sample=0.002, levels={2: 0.004})
    monkeypatch.setattr(planning, "_calibration", lambda *a: low)
    monkeypatch.setattr(overhead, "in_fresh_process", lambda fn, *a, **k: next(fresh))
    fresh = iter([None, high])
    args = (_mlp, _example, nn.functional.cross_entropy, _adam, 8, [8, 2])
    assert planning.calibrated(*args, samples=3).levels == {2: pytest.approx(0.003)}


def test_a_pipelines_sends_are_its_activations_per_microbatch() -> None:
    from scaletrain.plan.estimate import send_bytes

    p = profile_model(_deep, (torch.randn(8, 8), torch.randn(8, 8)), nn.functional.mse_loss, _adam)
    with torch.device("meta"):
        layers = list_layers(_deep())
    # 2 stages of 2 Linears: the second's output, 8 x 8 floats, over 4 microbatches.
    two = Layout("pipeline", pp=2, schedule="1f1b", microbatches=4)
    assert send_bytes(two, p, layers) == 8 * 8 * 4 / 4
    assert send_bytes(Layout("ddp", dp=2), p, layers) == 0.0


def test_an_interleaved_row_the_strategy_refuses_is_refused() -> None:
    cpu = Hardware("cpu", "2 cores", 10**12, {}, Link(0, 1e12), Link(0, 1e12), cores=2)
    compute = Compute(fixed=0.0, per_sample=0.01, optimizer=0.0, source="t")
    p = profile_model(_deep, (torch.randn(8, 8), torch.randn(8, 8)), nn.functional.mse_loss, _adam)
    with torch.device("meta"):
        layers = list_layers(_deep())

    def row(pp: int) -> Any:
        return estimate(
            Layout("pipeline", pp=pp, schedule="interleaved-1f1b", microbatches=4), p,
            layers=layers, tp_plan=None, compute=compute, comm=CommModel(default=Link(0, 1e12)),
            hw=cpu, overlap=0.0,
        )  # fmt: skip

    assert row(2).time.total > 0  # 4 layers: 2 chunks on each of 2 ranks
    with pytest.raises(ValueError, match="interleaving needs 8 stages"):
        row(4)


def test_a_broadcast_is_sends_in_turn_here_and_a_ring_on_a_profile() -> None:
    from scaletrain.plan.estimate import _broadcast

    comm = CommModel(default=Link(alpha=0.001, bandwidth=1e9))
    big = 1e9  # 1 s at the link's bandwidth
    # Gloo here: the root sends to each of the 3 others in turn.
    assert _broadcast(comm, big, 4, None, here=True) == pytest.approx(3 * 1.001)
    # NCCL's pipelined ring: the bytes once, a message's latency per further hop.
    assert _broadcast(comm, big, 4, None, here=False) == pytest.approx(1.001 + 2 * 0.001, rel=1e-6)
    assert _broadcast(comm, big, 1, None, here=True) == 0.0


def test_a_gpu_peak_counts_only_the_gradients_alive_with_the_activations() -> None:
    """CUDA's allocator peaks with the activations and the gradients made so far; the
    1B gpt's peak on an H200 was 12% under the sum that counts every gradient."""
    import scaletrain as st

    one = st.plan("gpt", devices=1, hardware="h100-sxm")
    m, prof = one.rows[0].memory, one.profile
    assert 0 <= prof.peak_grad_bytes < prof.grad_bytes and m.reused > 0
    assert m.reused == pytest.approx(
        min(m.activations, prof.grad_bytes - prof.peak_grad_bytes), abs=1
    )
    assert m.total == (
        m.params + m.grads + m.optimizer + m.activations + m.buffers + m.runtime - m.reused
    )
    assert m.total >= m.params + m.grads + m.optimizer  # the optimizer step's moment
    # DDP's gradients live in its buckets from setup: all of them at the peak.
    assert st.plan("gpt", devices=2, hardware="h100-sxm").row("ddp").memory.reused == 0


def test_gradients_count_whole_where_they_outlive_the_peak() -> None:
    """No reuse on this CPU machine (its RSS keeps what was freed), nor for a 1F1B stage
    with more microbatches than stages (its later forwards run beside its gradients)."""
    import scaletrain as st
    from scaletrain.plan.comm import CommModel
    from scaletrain.plan.estimate import Compute, estimate
    from scaletrain.plan.hardware import this_machine
    from scaletrain.plan.layouts import Layout
    from scaletrain.strategies.partition import list_layers
    from scaletrain.train.recipes import get_recipe

    two = st.plan("gpt", devices=2, hardware="h100-sxm", batch_size=32)
    piped = [r for r in two.rows if r.layout.strategy == "pipeline"]
    one_f = next(r for r in piped if r.layout.schedule == "1f1b")
    gpipe = next(r for r in piped if r.layout.schedule == "gpipe")
    assert (one_f.layout.microbatches or 1) > one_f.layout.pp
    assert one_f.memory.reused == 0 and gpipe.memory.reused > 0
    with torch.device("meta"):
        layers = list_layers(get_recipe("gpt").build())
    cpu = estimate(
        Layout("ddp"), two.profile, layers=layers, tp_plan=None,
        compute=Compute(0.0, 1e-3, 0.0, "test"), comm=CommModel(), hw=this_machine(1),
        overlap=0.0,
    )  # fmt: skip
    assert cpu.memory.reused == 0


def test_cpu_calibrations_time_the_fp32_step_at_any_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU planner's accuracy was measured on fp32 steps: a plan at another
    precision calibrates the same (fp16-mixed does not even run on a CPU)."""
    import scaletrain.plan.api as api
    import scaletrain.train.planning as planning
    from scaletrain.plan.estimate import Compute

    seen: list[str] = []

    def fake_runtime(*args: object, precision: str = "32", **kwargs: object) -> None:
        seen.append(precision)

    def fake_calibrate(*args: object, precision: str = "32", **kwargs: object) -> Compute:
        seen.append(precision)
        return Compute(0.0, 1e-3, 0.0, "test")

    monkeypatch.setattr(planning, "runtime_overhead", fake_runtime)
    monkeypatch.setattr(api, "calibrate", fake_calibrate)
    for precision in ("bf16-mixed", "fp16-mixed", "bf16-true"):
        planning._calibration(
            lambda: None, lambda b: None, None, None, 8, [8], None, None, precision
        )  # type: ignore[arg-type]
    assert seen == ["32"] * 6


def test_bf16_true_holds_the_weights_in_half_the_bytes() -> None:
    """bf16-true keeps parameters, gradients and the optimizer's state in bfloat16:
    planned as fp32 before, its memory read twice the run's."""
    import scaletrain as st

    full = st.plan("gpt", devices=1, hardware="h100-sxm").rows[0].memory
    half = st.plan("gpt", devices=1, hardware="h100-sxm", precision="bf16-true").rows[0].memory
    assert half.params * 2 == full.params and half.grads * 2 == full.grads
    assert half.optimizer * 2 == full.optimizer
    assert half.activations < full.activations


def _blocked_signals(q: Any) -> None:
    import signal

    q.put(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))


@pytest.mark.timeout(60)
def test_the_planners_children_never_see_ctrl_c_and_the_planner_still_does() -> None:
    # Ctrl-C reaches the terminal's whole process group. A child started inside
    # ctrl_c_held has SIGINT blocked from its first instruction (it printed its own
    # KeyboardInterrupt over the planner's one line); the planner's own Ctrl-C,
    # pending meanwhile, arrives when the block ends.
    import multiprocessing as mp
    import os
    import signal

    from scaletrain.plan.children import ctrl_c_held

    if not hasattr(signal, "pthread_sigmask"):
        pytest.skip("no signal masks here")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Python's own handler, as in a terminal (a background job starts with SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        child = ctx.Process(target=_blocked_signals, args=(q,))
        child.start()
        os.kill(os.getpid(), signal.SIGINT)  # pending, not lost
    signal.signal(signal.SIGINT, before)
    assert int(signal.SIGINT) in q.get(timeout=30)
    child.join(timeout=30)
    assert int(signal.SIGINT) not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def _report_or_hang(rank: int, n: int, port: int, q: Any) -> None:
    import time as clock

    if rank == 0:
        q.put({"done": rank})
        q.close()
        q.join_thread()
        return
    clock.sleep(600)  # a rank stuck on its way out (in a collective whose peers are gone)


@pytest.mark.timeout(60)
def test_a_probes_ranks_are_killed_once_rank_0_reported() -> None:
    # Joined one by one before any was killed, a rank stuck on its way out held the
    # planner up to 10 s, and a Ctrl-C during that wait left it running for good
    # (SIGINT blocked in it), holding the terminal's output open.
    import time

    from scaletrain.plan.probe import _ranks

    t0 = time.monotonic()
    assert _ranks(2, time.monotonic() + 30, 30, _report_or_hang) == {"done": 0}
    assert time.monotonic() - t0 < 8
    import multiprocessing as mp

    assert not [p for p in mp.active_children() if p.is_alive()]
