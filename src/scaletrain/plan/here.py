"""What `scaletrain plan` measures of this machine beyond one process's calibration: the
Gloo probe it runs for a plan's rows (`probe_here`, scaletrain.plan.probe), and how
the probe's measurements of ranks sharing the machine read as the plan's assumptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain.plan.calibration import Example
from scaletrain.plan.comm import CommModel
from scaletrain.plan.estimate import send_bytes, step_collectives
from scaletrain.plan.hardware import usable_cores
from scaletrain.plan.layouts import Layout
from scaletrain.plan.probe import STRATEGY_STEPS
from scaletrain.plan.profile import ModelProfile
from scaletrain.strategies.partition import Layer

__all__ = ["probe_here"]


def _say_side_by_side(
    comm: CommModel, devices: int, assumptions: list[str], sharded: bool = False, size: int = 0
) -> None:
    """The probe's measurements of ranks sharing this machine, as assumptions
    (`sharded`: the model's fully sharded steps were sent to be measured; `size`, the
    bytes at which to say what its collectives cost: the gradients')."""
    timed = [k for k in ("all_reduce", "all_gather", "reduce_scatter") if (k, devices) in comm.busy]
    if timed and size > 0:
        each = ", ".join(
            f"{k.replace('_', '-')} {comm.time(k, size, devices, comm.busy[(k, devices)]) * 1e3:.2f}"
            f" ms ({comm.time(k, size, devices) * 1e3:.2f} ms back to back)"
            for k in timed
        )
        assumptions.append(
            f"collectives as a step reaches them, every rank coming from work (measured; the "
            f"rows' DDP, FSDP and tensor-parallel collectives cost these): at {size / 2**10:.0f} "
            f"KiB, {each}"
        )
    if devices in comm.meeting:
        assumptions.append(
            f"a collective reached from work (every core busy) costs "
            f"{comm.meeting[devices] * 1e3:.2f} ms beyond a quiet one (measured)"
        )
    if ("fsdp", devices) in comm.step_growth:
        assumptions.append(
            f"FSDP's steps over {devices} ranks grew RSS by "
            f"{comm.step_growth[('fsdp', devices)] / 2**20:.1f} MiB in {STRATEGY_STEPS} steps "
            "(measured: the allocator keeps what FSDP frees, and keeps more for a while); "
            "its row's growth is at least that"
        )
    elif sharded:
        assumptions.append(
            "FSDP's steps not measured (the model's step did not load or run fully sharded "
            "in the probe's processes, or RSS cannot be read here): its row's memory is "
            "its tensors' and the runtime's, without what the allocator keeps"
        )
    if ("tensor", devices) in comm.step_growth:
        assumptions.append(
            f"tensor parallel's steps over {devices} ranks grew RSS by "
            f"{comm.step_growth[('tensor', devices)] / 2**20:.1f} MiB in {STRATEGY_STEPS} "
            "steps (measured); its row's growth is at least that"
        )
    for strategy, what in (
        ("fsdp", "an FSDP rank's work (FSDP's copies and hooks around each unit)"),
        ("tensor", "a tensor-parallel rank's work (its shards and DTensor's dispatch)"),
    ):
        if (strategy, devices) in comm.step_cpu:
            at = f" at {comm.batch} samples" if comm.batch else ""
            assumptions.append(
                f"{what} among {devices} ranks takes "
                f"{comm.step_cpu[(strategy, devices)] * 1e3:.1f} ms of CPU a step{at} "
                "(measured, every rank stepping, its collectives' own CPU aside)"
            )
    side = comm.concurrency.get(devices)
    if side is not None:
        assumptions.append(
            f"{side.ranks} ranks stepping side by side take x{side.factor:.2f} the CPU of one "
            f"alone, and each step waits for the slowest of {devices} (x{side.sync(devices):.2f} "
            "a median step): measured"
        )
    elif devices > 1:
        why = (
            "one core: no two ranks run at once"
            if usable_cores() < 2
            else "the model's factory, loss or optimizer did not reach the probe's processes "
            "(they go by reference: define them in an importable module), or its step failed there"
        )
        assumptions.append(
            f"ranks side by side not measured ({why}): no contention, no wait for the slowest"
        )


def probe_here(
    build: Callable[[], nn.Module],
    example: Example,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    batch_size: int,
    devices: int,
    profile: ModelProfile,
    layers: Sequence[Layer],
    layouts: Sequence[Layout],
    tp_plan: Mapping[str, str] | None,
    fsdp_units: Sequence[str] | None,
    step_seconds: float = 0.0,
    cores: int | None = None,
) -> CommModel:
    """The Gloo probe `plan_model` runs on this machine for these rows (scaletrain.plan
    .probe): the collectives at the gradients' sizes and a pipeline's sends, the model's
    step side by side, and the steps of the rows that need their own (FSDP's memory,
    tensor parallel's CPU). `step_seconds`, the plain step's, sizes its timeout;
    `cores`, the machine's. No probe (an empty model) for one device."""
    from scaletrain.plan.overhead import model_step, sharded_step, tensor_step
    from scaletrain.plan.probe import probe

    if devices <= 1:
        return CommModel()
    # The gradients' sizes (DDP's buckets, FSDP's units), and a pipeline's sends.
    sizes = sorted(
        {profile.grad_bytes, max(4096, profile.grad_bytes // 8)}
        | {max(4096, int(send_bytes(x, profile, layers))) for x in layouts if x.pp > 1}
    )
    work = partial(model_step, build, example(batch_size), loss_fn, optimizer)
    sharded = None
    if any(x.strategy == "fsdp" and x.dp == devices for x in layouts):
        units = tuple(fsdp_units if fsdp_units is not None else (x.name for x in layers))
        sharded = partial(sharded_step, build, example(batch_size), loss_fn, optimizer, units)
    tensored = None
    if tp_plan and any(x.strategy == "tensor" and x.tp == devices for x in layouts):
        tensored = partial(tensor_step, build, example(batch_size), loss_fn, optimizer,
                           dict(tp_plan))  # fmt: skip
    # Room for the probe's few dozen steps of the model, however slow, and its fully
    # sharded and tensor-parallel ones (~3x the plain step's CPU each, every rank at
    # once: taking turns where the ranks outnumber the cores).
    turns = max(1.0, devices / (cores or devices))
    room = 40 + (3 * STRATEGY_STEPS * turns if sharded is not None else 0)
    room += 3 * STRATEGY_STEPS * turns if tensored is not None else 0
    return probe(
        devices,
        sizes,
        work=work,
        sharded=sharded,
        timeout=120 + room * step_seconds,
        hop_sizes=[int(send_bytes(x, profile, layers)) for x in layouts if x.pp > 1],
        tensored=tensored,
        collectives=step_collectives(profile, layers, tp_plan, fsdp_units),
        batch=batch_size,
    )
