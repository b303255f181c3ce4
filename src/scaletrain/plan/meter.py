"""How the planner times and weighs a step on the device it runs on.

CPU (Gloo ranks sharing this machine's cores): CPU seconds of the process, call by
call (what a rank needs of a core; the estimate turns them into wall time by how
the ranks share the cores), and the process's RSS.

CUDA: the host queues a step's kernels and runs ahead of the GPU, so one call's
time means nothing alone. A step's time is the time between steps when they run
back to back, as a run's do and as the step ledger's CUDA events time them: a block
of calls synchronised at both ends, divided by its length. Memory is the caching
allocator's peak of allocated bytes, what the ledger reports as `allocated_peak`
(cuBLAS's and cuDNN's workspaces come from that allocator too; NCCL's buffers and
the CUDA context do not).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["BLOCK", "Peak", "in_turns", "is_cuda", "median_time", "move", "sync"]

BLOCK = 4
"""Calls per synchronised block on a GPU."""


def is_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def sync(device: torch.device | None) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def move(value: Any, device: torch.device | None) -> Any:
    """Tensors in `value` (nested tuples, lists, dicts) on `device` (None: as they are)."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    return value


def _block(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds per call of BLOCK calls back to back (synchronised at both ends)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(BLOCK):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / BLOCK


def _spent(fn: Callable[[], Any], device: torch.device | None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one call of `fn`; on a GPU both are the wall
    seconds per call of a back-to-back block."""
    if device is not None and is_cuda(device):
        wall = _block(fn, device)
        return wall, wall
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def median_time(
    fn: Callable[[], Any], repeats: int, device: torch.device | None = None
) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of a call of `fn` after one warm-up call.
    On a GPU both are the wall seconds per call of back-to-back blocks."""
    fn()
    cpu, wall = zip(*(_spent(fn, device) for _ in range(max(1, repeats))), strict=True)
    return statistics.median(cpu), statistics.median(wall)


def in_turns(
    steps: Mapping[str, Callable[[], Any]], repeats: int, device: torch.device | None = None
) -> dict[str, float]:
    """Median seconds of each step, the steps run in turns (one of each, `repeats`
    times, after two warm-up turns), so that a drift of the machine (the same bare loop
    ran 25% slower later in one process here) hits all of them alike; the warm-up turns
    fill DTensor's sharding caches and FSDP's buffers. CPU seconds on a CPU, a turn's
    wall seconds per call of a back-to-back block on a GPU."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(repeats + 2):
        for name, step in steps.items():
            spent = _spent(step, device)[0]
            if i >= 2:
                times[name].append(spent)
    return {name: statistics.median(t) for name, t in times.items()}


def _clear_blas_workspaces() -> None:
    """Free cuBLAS's (and cuBLASLt's) workspaces, so that the stretch measured next
    allocates them again and counts them. They come from CUDA's caching allocator, one
    per handle and stream, 32 MiB each on Hopper, and stay allocated for the process's
    life: a run's `allocated_peak` holds them (its first product, or the ledger's FLOP/s
    measurement, allocated them), while a plan made in a process that had already
    multiplied matrices measured none of them (a 1-GPU split-net run read 65 MiB against
    0.02 planned on an H200). PyTorch's own leak checks clear them the same way."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class Peak:
    """The memory a stretch of work adds at its peak: the RSS's on a CPU (None where
    the peak cannot be restarted), CUDA's allocated bytes on a GPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        from scaletrain.observe.memory import current_rss_bytes, reset_rss_peak

        self.device = device
        if is_cuda(device):
            sync(device)
            _clear_blas_workspaces()
            torch.cuda.reset_peak_memory_stats(device)
            self.start: int | None = int(torch.cuda.memory_allocated(device))
        else:
            self.start = current_rss_bytes() if reset_rss_peak() else None

    def growth(self) -> int | None:
        from scaletrain.observe.memory import rss_peak_bytes

        if self.start is None:
            return None
        if is_cuda(self.device):
            sync(self.device)
            return int(torch.cuda.max_memory_allocated(self.device)) - self.start
        return rss_peak_bytes() - self.start
