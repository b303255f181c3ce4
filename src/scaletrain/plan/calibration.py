"""`calibrate`: the real model's training step timed on this machine (its CPU, one
thread, as every rank of a CPU job runs; or its GPU), and the memory the steps add."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from scaletrain.plan.costs import Compute
from scaletrain.plan.layertime import layer_shares
from scaletrain.precision import Precision
from scaletrain.strategies.partition import list_layers

__all__ = ["CALIBRATED", "CALIBRATED_GPU", "Example", "calibrate"]

Example = Callable[[int], tuple[Any, Any]]
"""batch size -> (inputs, targets) of that many samples."""

CALIBRATED = "calibrated here: CPU seconds, 1 thread"
"""Compute.source of a calibration on this machine's CPU."""
CALIBRATED_GPU = "calibrated here: GPU seconds"
"""Compute.source of a calibration on this machine's GPU."""


def calibrate(
    build: Callable[[], nn.Module],
    example: Example,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    sizes: list[int],
    *,
    repeats: int = 5,
    stage_batch: int | None = None,
    device: torch.device | None = None,
    precision: str = "32",
) -> Compute:
    """Time the real model here: forward+backward at each batch size, and the optimizer
    step, in this process with one thread (as every rank of a CPU job runs).

    On a CPU (`device` None or cpu) times are CPU seconds (what a rank needs of a core);
    their ratio to wall time is the share of a core this process got (the machine's
    other load). The RSS the steps add is measured too (from a restarted peak): in a
    fresh process it holds the runtime's first-step overhead that no tensor accounting
    sees. On a GPU (`device` cuda) times are the GPU's seconds per step back to back,
    and the memory CUDA's allocator adds at its peak (plan/meter.py). Given
    `stage_batch` (a pipeline's microbatch), each layer's share of the step at that
    batch (plan/layertime.py, CPU only), which a pipeline's stages take of it.
    Mixed precisions run the forward under autocast, as the runtime does, bf16-true
    the model in bfloat16 (the planner asks this on GPUs only: its CPU calibrations
    time the fp32 step, as they were checked against the runs).
    """
    from scaletrain.plan.meter import Peak, is_cuda, median_time, move

    on_gpu = is_cuda(device)
    # As the runtime computes (scaletrain.precision): mixed precisions' forward under
    # autocast, bf16-true's weights and floating inputs in bfloat16.
    prec = Precision(name=precision, device=device or torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build()
        if device is not None:
            model = model.to(device)
        model = prec.convert_module(model)
        opt = optimizer(model.parameters())
        points: dict[int, float] = {}
        cpu_total = wall_total = 0.0
        peak = Peak(device)
        for b in sorted(set(sizes), reverse=True):
            x, y = move(example(b), device)
            x = prec.convert_input(x)

            def step(x: Any = x, y: Any = y) -> None:
                opt.zero_grad(set_to_none=True)
                with prec.forward_context():
                    loss = loss_fn(model(x), y)
                loss.backward()

            cpu, wall = median_time(step, repeats, device)
            points[b] = cpu
            cpu_total, wall_total = cpu_total + cpu, wall_total + wall
        opt_cpu, opt_wall = median_time(opt.step, repeats, device)
        # After the optimizer's steps: its state (Adam's two moments) is part of what a
        # run's steps add; measured before them, the runtime term came out that much
        # short (gpt: 13 MiB, a quarter of its growth).
        growth = peak.growth()
        # A pipeline's stages: each layer's share of the step at the microbatch.
        shares = (
            layer_shares(model, example(stage_batch), loss_fn, list_layers(model))
            if stage_batch and not on_gpu
            else None
        )
    finally:
        torch.set_num_threads(threads)
    share = min(1.0, (cpu_total + opt_cpu) / max(wall_total + opt_wall, 1e-9))
    fitted = Compute.fit(
        points, opt_cpu, CALIBRATED_GPU if on_gpu else CALIBRATED, share=share,
        load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None, measured_growth=growth,
    )  # fmt: skip
    # On this CPU, each size's own time where a row asks for it (Compute.levels).
    levels = {} if on_gpu else dict(points)
    return replace(fitted, layer_shares=shares or {}, levels=levels)
