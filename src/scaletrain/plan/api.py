"""`plan_model`: every layout of N devices for one model, as data and as a table."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, near_fix, spell, unknown
from scaletrain.plan.calibration import (
    CALIBRATED,
    CALIBRATED_GPU,
    Example,
    calibrate,
)
from scaletrain.plan.comm import CommModel
from scaletrain.plan.estimate import Compute, Estimate, estimate, send_bytes
from scaletrain.plan.hardware import PROFILES, this_gpu, this_machine
from scaletrain.plan.here import _say_side_by_side, probe_here
from scaletrain.plan.layouts import Layout, layouts_for
from scaletrain.plan.profile import profile_model
from scaletrain.plan.result import Plan, throughput
from scaletrain.precision import AUTOCAST_DTYPES, canonical
from scaletrain.strategies.partition import Layer, list_layers

__all__ = [
    "PRECISIONS",
    "Plan",
    "calibrate",
    "calibration_sizes",
    "check_request",
    "measuring_device",
    "plan_model",
    "stage_batch",
    "throughput",
]

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "bf16-true")
DEFAULT_OVERLAP = {"this-machine": 0.0, "datasheet": 0.5}
"""Fraction of DDP/FSDP gradient communication hidden behind the backward when no run
measured it: none on a CPU (Gloo works on the cores the backward needs), half on GPUs."""


def check_request(
    devices: Any,
    nodes: Any,
    hardware: Any,
    precision: Any,
    batch: Any,
    device: Any = None,
    mfu: Any = None,
) -> None:
    """Refuse a bad request before any work, naming the setting (in the caller's words)."""
    if mfu is not None:
        if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
            raise ConfigError(
                f"{spell('mfu', mfu)} must be a fraction of the datasheet peak in (0, 1], "
                f"e.g. {spell('mfu', 0.4)} (a run's measured MFU: its ledger summary).",
                field="mfu",
            )
        if hardware is None:
            raise ConfigError(
                f"{spell('mfu', mfu)} sets a datasheet profile's achieved fraction of peak, "
                f"but no {spell('hardware')} was given: this machine is measured, not "
                f"assumed. Fix: add {spell('hardware', 'h100-sxm')}, or drop {spell('mfu')}.",
                field="mfu",
            )
    for key, value, low in (("devices", devices, 1), ("nodes", nodes, 1), ("batch_size", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(
                f"{spell(key, value)} must be a whole number >= {low}, e.g. {spell(key, 4)}.",
                field=key,
            )
    if devices % nodes:
        raise ConfigError(
            f"{spell('devices', devices)} over {spell('nodes', nodes)}: the devices must split "
            f"evenly over the nodes. Fix: {spell('devices', nodes * max(1, devices // nodes))}.",
            field="devices",
        )
    if hardware is not None and hardware not in PROFILES:
        raise ConfigError(
            f"{spell('hardware', hardware)} is not a known profile; expected one of "
            f"{', '.join(PROFILES)}, or leave it out to measure this machine."
            + near_fix("hardware", hardware, list(PROFILES)),
            field="hardware",
        )
    if hardware is None and nodes > 1:
        raise ConfigError(
            f"{spell('nodes', nodes)} cannot be measured on this one machine. Fix: "
            f"{spell('hardware', 'h100-sxm')} (or another profile: {', '.join(PROFILES)}) "
            "for a cluster on paper, or leave out the nodes.",
            field="nodes",
        )
    if canonical(precision) not in PRECISIONS:
        raise ConfigError(unknown("precision", precision, PRECISIONS), field="precision")
    if device is not None and hardware is not None:
        raise ConfigError(
            f"{spell('device', device)} picks what this machine measures, but "
            f"{spell('hardware', hardware)} plans on paper: nothing is measured. Fix: drop "
            f"one of them.",
            field="device",
        )
    if device not in (None, "cpu", "cuda"):
        raise ConfigError(
            f"{spell('device', device)} is not known; expected 'cpu' or 'cuda', or leave it "
            "out (this machine's GPU where it has one, else its CPU).",
            field="device",
        )
    if device == "cuda" and hardware is None and not torch.cuda.is_available():
        raise ConfigError(
            f"{spell('device', device)}: this machine has no CUDA GPU to measure. Fix: "
            f"leave {spell('device')} out to measure its CPU, or {spell('hardware', 'h100-sxm')} "
            "to plan GPUs on paper.",
            field="device",
        )
    if measuring_device(hardware, device) is not None and devices > 1:
        raise ConfigError(
            f"{spell('devices', devices)} on this GPU machine: a measured plan covers one "
            "GPU here (the probe of several devices runs Gloo processes on the CPU, which "
            f"say nothing of NCCL between GPUs). Fix: {spell('devices', 1)} to measure this "
            f"GPU, or {spell('hardware', 'h100-sxm')} (or {', '.join(x for x in PROFILES if x != 'h100-sxm')}) "
            f"to plan {devices} GPUs on paper, or {spell('device', 'cpu')} for {devices} "
            "CPU processes.",
            field="devices",
        )


def measuring_device(hardware: str | None, device: str | None = None) -> torch.device | None:
    """Where a plan measures the model: this machine's GPU where it has one (CUDA), no
    profile is named and `device` is not "cpu", else None (its CPU: one-thread Gloo
    processes)."""
    if hardware is not None or device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _with_overheads(
    compute: Compute,
    build: Callable[[], nn.Module],
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    tp_plan: Mapping[str, str] | None,
    layers: list[Layer],
    microbatches: int | None,
    assumptions: list[str],
) -> Compute:
    from scaletrain.plan.overhead import measure_overheads

    found = measure_overheads(
        build, batch, loss_fn, optimizer, tp_plan=tp_plan, layers=[x.name for x in layers],
        microbatches=microbatches,
    )  # fmt: skip
    if found is None:
        assumptions.append(
            "DDP's, tensor parallel's, FSDP's and pipelines' own per-step cost not measured (this "
            "process is already in a process group): their rows count FLOPs and collectives only"
        )
        return compute
    assumptions.append(
        "per-step cost of the strategies' machinery, measured on this model: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in found.items())
    )
    return replace(compute, overhead={**compute.overhead, **found})


def _scaled(compute: Compute) -> str:
    """The calibration's scale to the training loop, where it is not 1."""
    if abs(compute.scale - 1.0) < 0.005:
        return ""
    return (
        f"; the model's step timed in parts (forward+backward, optimizer), x{compute.scale:.2f} "
        "to the training loop's whole step"
    )


def _recommend(rows: list[Estimate], batch: int) -> tuple[Estimate | None, str]:
    # Rows differ in samples per step (dp replicas x batch): compared by throughput.
    fitting = sorted((r for r in rows if r.fits), key=lambda r: -throughput(r, batch))
    if not fitting:
        return None, "nothing fits: every layout overflows a device (see the rows marked NO)"
    best = fitting[0]
    t = best.time
    why = (
        f"{best.layout.label}: the highest throughput that fits, "
        f"{throughput(best, batch):,.0f} samples/s ({t.total * 1e3:.1f} ms per step of "
        f"{batch * best.layout.dp} samples: compute {t.compute * 1e3:.1f}, exposed comm "
        f"{t.exposed * 1e3:.1f}, bubble {t.bubble * 1e3:.1f}, wait {t.wait * 1e3:.1f})"
    )
    if len(fitting) > 1:
        nxt = fitting[1]
        ratio = throughput(best, batch) / max(throughput(nxt, batch), 1e-12)
        why += f", {ratio:.2f}x {nxt.layout.label}"
    return best, why


def stage_batch(layouts: Sequence[Layout], batch: int) -> int | None:
    """The microbatch of the plan's first pipeline (None: no pipeline among the rows)."""
    staged = [x for x in layouts if x.pp > 1]
    return max(1, batch // (staged[0].microbatches or 1)) if staged else None


def calibration_sizes(layouts: Sequence[Layout], batch: int) -> list[int]:
    """The batch sizes a calibration times for these rows: the batch, and each pipeline's
    microbatch."""
    return [batch] + [batch // (x.microbatches or 1) for x in layouts]


def plan_model(
    build: Callable[[], nn.Module],
    example: Example,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    batch_size: int,
    devices: int,
    nodes: int = 1,
    hardware: str | None = None,
    precision: str = "32",
    tp_plan: Mapping[str, str] | None = None,
    overlap: float | None = None,
    compute: Compute | None = None,
    comm: CommModel | None = None,
    name: str | None = None,
    layouts: list[Layout] | None = None,
    fsdp_units: Sequence[str] | None = None,
    device: str | None = None,
    mfu: float | None = None,
) -> Plan:
    """Plan `build()` over `devices` (see scaletrain.plan.estimate for the model).

    `fsdp_units`: the modules FSDP shards as units, by name (`scaletrain plan` gives
    the fsdp strategy's wrap); the FSDP rows' collectives and the probe's fully sharded
    steps use them (default: each of the model's layers, and the root).

    `hardware` None measures this machine: its GPU where it has one (one device; `device`
    "cpu" measures its CPU instead), else its CPU (a short calibration and a Gloo
    probe); a profile name (scaletrain.plan.hardware.PROFILES) plans on paper, its
    compute at `mfu` of the datasheet peak (default the profile's assumption, 40%; a
    run's measured MFU grounds it for layouts like that run's: tensor and pipeline
    shards run smaller matrix products, which reach less). `compute` and
    `comm` replace the measurements (a benchmark measures them once for many plans).
    """
    precision = canonical(precision)  # bf16 is bf16-mixed, as st.init takes it
    check_request(devices, nodes, hardware, precision, batch_size, device, mfu)
    with torch.device("meta"):
        layers = list_layers(build())
    if layouts is None:
        layouts = layouts_for(
            devices, batch=batch_size, layers=len(layers), tensor_ok=bool(tp_plan)
        )
    where = measuring_device(hardware, device)
    if hardware is not None:
        hw = PROFILES[hardware]
        if mfu is not None:
            hw = replace(hw, compute_efficiency=float(mfu))
    else:
        hw = this_gpu(where) if where is not None else this_machine(devices)
    if hardware is not None and nodes == 1 and devices > hw.devices_per_node:
        # A cluster of the profile's nodes: devices beyond one node's are on others.
        nodes = -(-devices // hw.devices_per_node)
    assumptions: list[str] = []
    if compute is None and hardware is None:
        # First, in a fresh process: the real steps' RSS growth then holds the runtime's
        # first-step overhead (kernel workspaces, allocator and autograd state), which
        # the fake forward/backward below would otherwise have paid in part already.
        # (st.plan passes the fuller calibration: the training runtime's own loop, in 3
        # processes, scaletrain.train.planning.calibrated; this package cannot run it.)
        compute = calibrate(
            build, example, loss_fn, optimizer, calibration_sizes(layouts, batch_size),
            stage_batch=stage_batch(layouts, batch_size), device=where,
            precision=precision if where is not None else "32",
        )  # fmt: skip
    if compute is not None and compute.source == CALIBRATED_GPU:
        assumptions.append(
            f"calibrated on this GPU: the model's step "
            f"{(compute.fwd_bwd(batch_size) + compute.optimizer) * 1e3:.1f} ms, steps back to back"
            + (
                f", and the training runtime's around it {compute.overhead['step'] * 1e3:.1f} ms"
                if "step" in compute.overhead
                else ""
            )
            + _scaled(compute)
        )
    if compute is not None and compute.source == CALIBRATED:
        busy = compute.background(hw.cores or 1)
        assumptions.append(
            f"other programs on this machine seem to keep about {busy:.1f} threads busy, "
            f"which the ranks would share its {hw.cores or 1} cores with (what the "
            f"calibration's process getting {compute.share:.0%} of a core implies)"
            if busy > 0
            else f"no other load seen on this machine (the calibration's process got "
            f"{compute.share:.0%} of a core)"
        )
        if "step" in compute.overhead:
            assumptions.append(
                f"the training runtime's step around the model: "
                f"{compute.overhead['step'] * 1e3:.1f} ms CPU per step (measured)"
                + _scaled(compute)
            )
    profile = profile_model(
        build, example(batch_size), loss_fn, optimizer,
        autocast_dtype=AUTOCAST_DTYPES.get(precision), name=name,
        param_dtype=torch.bfloat16 if precision == "bf16-true" else None,
    )  # fmt: skip
    if compute is None:
        compute = Compute.from_flops(profile, hw, precision)
        assumptions.append(
            f"compute at {hw.compute_efficiency:.0%} of the datasheet peak "
            f"({hw.peak_flops[precision] / 1e12:.0f} TFLOP/s at precision {precision})"
            + (" (given)" if mfu is not None else " (the profile's assumption; --mfu sets it)")
        )
    if comm is None:
        if hardware is None:
            step = compute.fwd_bwd(batch_size) + compute.optimizer if compute else 0.0
            comm = probe_here(
                build, example, loss_fn=loss_fn, optimizer=optimizer, batch_size=batch_size,
                devices=devices, profile=profile, layers=layers, layouts=layouts,
                tp_plan=tp_plan, fsdp_units=fsdp_units, step_seconds=step, cores=hw.cores,
            )  # fmt: skip
            sharded = any(x.strategy == "fsdp" and x.dp == devices for x in layouts)
            _say_side_by_side(comm, devices, assumptions, sharded, profile.grad_bytes)
        else:
            comm = CommModel(default=hw.intra, source=hw.name)
            assumptions.append(
                f"links at datasheet bandwidth; alpha {hw.intra.alpha * 1e6:.0f} us inside a "
                f"node, {hw.inter.alpha * 1e6:.0f} us between nodes (typical, not measured)"
            )
    staged = [x for x in layouts if x.pp > 1]
    hop = comm.stage_hop.get(devices) if hardware is None else None
    if staged and hop is not None:
        size = send_bytes(staged[0], profile, layers)
        assumptions.append(
            f"a pipeline's hop of {size / 2**10:.0f} KiB between stages: "
            f"{comm.time('send', size, 2, hop) * 1e3:.2f} ms as a stage makes it "
            f"(the probe's: the sender goes on with its work, the other ranks compute), "
            f"{comm.time('send', size, 2) * 1e3:.2f} ms quiet"
        )
    if hardware is None and staged and not compute.trace_bytes:
        from scaletrain.plan.overhead import trace_bytes

        m = staged[0].microbatches or 1
        traced = trace_bytes(build, (example(max(1, batch_size // m))[0],))
        if traced is not None:
            compute = replace(compute, trace_bytes=traced)
            assumptions.append(
                f"a pipeline rank's trace of the model: {traced / 2**20:.1f} MiB (measured)"
            )
    machinery = any(x.tp > 1 or x.pp > 1 or x.dp > 1 for x in layouts)
    if (
        hardware is None
        and machinery
        and not {"ddp", "tensor", "fsdp", "pipeline"} & set(compute.overhead)
    ):
        # Per op, not per sample: measured at a small batch, which keeps it to seconds.
        microbatches = staged[0].microbatches if staged else None
        compute = _with_overheads(compute, build, example(min(batch_size, 8)), loss_fn,
                                  optimizer, tp_plan, layers, microbatches, assumptions)  # fmt: skip
    if compute.measured_growth is not None and not compute.runtime_bytes:
        one = estimate(
            Layout("ddp"), profile, layers=layers, tp_plan=None, compute=compute,
            comm=CommModel(), hw=hw, overlap=0.0,
        )  # fmt: skip
        compute = replace(
            compute, runtime_bytes=max(0, compute.measured_growth - one.memory.growth)
        )
    if hw.cores is not None:
        wanted = compute.background(hw.cores) + devices
        if wanted > hw.cores:
            assumptions.append(
                f"{devices} processes and the other load on {hw.cores} cores take turns: "
                f"compute x{wanted / hw.cores:.1f} (a pipeline's less: its stages idle as "
                "they fill and drain it)"
            )
    if overlap is None:
        overlap = DEFAULT_OVERLAP["this-machine" if hardware is None else "datasheet"]
        assumptions.append(
            f"{overlap:.0%} of DDP/FSDP gradient communication hidden behind the backward "
            "(no measured run given)"
        )
    rows = [
        estimate(
            x,
            profile,
            layers=layers,
            tp_plan=tp_plan,
            compute=compute,
            comm=comm,
            hw=hw,
            overlap=overlap,
            nodes=nodes,
            fsdp_units=fsdp_units,
        )
        for x in layouts
    ]
    best, reason = _recommend(rows, batch_size)
    return Plan(
        model=profile.model, devices=devices, nodes=nodes, hardware=hw, precision=precision,
        profile=profile, rows=rows, recommended=best, reason=reason, assumptions=assumptions,
    )  # fmt: skip
