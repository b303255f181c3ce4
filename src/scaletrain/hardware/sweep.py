"""The collective sweep of `scaletrain plan --calibrate`: over `processes` ranks of this
node (NCCL across its GPUs; Gloo on loopback on a CPU, each rank one thread), each
collective timed from 4 KiB up (to 16 MiB on a CPU, 256 MiB on GPUs), each size in
batches, the fastest batch's mean kept and the slowest rank's taken; `fit` then finds
alpha and the bus bandwidth of time = alpha + factor(kind, n) * bytes / bandwidth
(hardware.bus_factor).

The ranks are spawned with SIGINT blocked (a Ctrl-C reaches the calibrating process
alone, which kills them), bound to a free port, and killed on any failure or after a
timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.hardware import (
    COLLECTIVES,
    bus_factor,
)

__all__ = ["SWEEP_TIMEOUT", "CalibrationError", "fit", "message_sizes", "sweep"]

KiB, MiB = 2**10, 2**20
SWEEP_TIMEOUT = 600.0
"""Seconds the collective sweep may take before its processes are killed."""


class CalibrationError(ScaletrainError):
    """The calibration's processes failed, died or timed out (each rank's story)."""


def message_sizes(cuda: bool, quick: bool) -> list[int]:
    """4 KiB up by 4x: to 256 MiB on GPUs, 16 MiB on a CPU; `quick`: every other one."""
    top = 256 * MiB if cuda else 16 * MiB
    sizes = [4 * KiB * 4**i for i in range(12) if 4 * KiB * 4**i <= top]
    return sizes[::2] if quick else sizes


def fit(kind: str, n: int, samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) of time = alpha + factor * bytes /
    bandwidth over (bytes, seconds) samples of `kind` over n ranks: least squares on the
    relative error (sizes span three orders; each size counts alike). Where noise makes
    a coefficient non-positive, the smallest message's time is taken as alpha, and if
    time still does not grow with size, the best throughput seen is the bandwidth."""
    factor = bus_factor(kind, n)
    xs = [factor * b for b, _ in samples]
    ys = [max(t, 1e-12) for _, t in samples]
    # Minimise sum((alpha + s x - y) / y)^2: rows (1/y, x/y), target 1.
    suu = sum(1 / y**2 for y in ys)
    suv = sum(x / y**2 for x, y in zip(xs, ys, strict=True))
    svv = sum((x / y) ** 2 for x, y in zip(xs, ys, strict=True))
    su = sum(1 / y for y in ys)
    sv = sum(x / y for x, y in zip(xs, ys, strict=True))
    det = suu * svv - suv**2
    alpha = slope = 0.0
    if len(set(xs)) >= 2 and det > 0:
        alpha = (su * svv - sv * suv) / det
        slope = (suu * sv - suv * su) / det
    if alpha <= 0 or slope <= 0:
        first = min(range(len(xs)), key=lambda i: xs[i])
        alpha = ys[first]
        weights = [1 / y**2 for y in ys]
        den = sum(w * x * x for w, x in zip(weights, xs, strict=True))
        num = sum(w * x * (y - alpha) for w, x, y in zip(weights, xs, ys, strict=True))
        slope = num / den if den > 0 else 0.0
    if slope <= 0 or not math.isfinite(slope):
        slope = min(y / x for x, y in zip(xs, ys, strict=True) if x > 0)
    return alpha, 1 / slope


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _children_environment() -> Iterator[None]:
    """While ranks start: SIGINT blocked (a child inherits the mask and so never acts
    on a Ctrl-C, which this process answers by killing it) and OMP_NUM_THREADS=1 (the
    children's torch reads it at import)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    mask = getattr(signal, "pthread_sigmask", None)
    old = mask(signal.SIG_BLOCK, {signal.SIGINT}) if mask is not None else None
    try:
        yield
    finally:
        if mask is not None and old is not None:
            mask(signal.SIG_SETMASK, old)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def sweep(
    n: int,
    backend: str,
    sizes: Sequence[int],
    *,
    quick: bool = False,
    timeout: float = SWEEP_TIMEOUT,
) -> dict[str, list[tuple[float, float]]]:
    """(bytes, seconds) of each collective at each size over `n` spawned ranks of
    `backend` ("gloo" or "nccl"); the ranks are killed on failure, timeout or Ctrl-C."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    budget = (0.01 if quick else 0.02) if backend == "nccl" else (0.02 if quick else 0.05)
    procs: list[Any] = []
    finished = False
    try:
        with _children_environment():
            for rank in range(n):
                p = ctx.Process(
                    target=_rank_main,
                    args=(rank, n, port, backend, list(sizes), budget, timeout, results),
                    daemon=True,
                )
                p.start()
                procs.append(p)
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CalibrationError(
                    f"the calibration's collective sweep over {n} {backend} processes did "
                    f"not finish in {timeout:.0f} s; they were stopped. Fix: run it again "
                    "on an idle machine, or measure fewer processes."
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode]
                if dead:
                    raise CalibrationError(
                        f"the calibration's process {dead[0]} (of {n}, {backend}) died with "
                        f"exit code {procs[dead[0]].exitcode}; the others were stopped."
                    ) from None
                continue
            if not ok:
                raise CalibrationError(
                    f"the calibration's process {rank} (of {n}, {backend}) failed; the "
                    f"others were stopped. Its error:\n{payload}"
                )
            done[rank] = payload
        finished = True
        return dict(done[0])
    finally:
        for p in procs:
            # Done: each rank leaves its group and exits; else none is waited for.
            p.join(timeout=10 if finished else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.cancel_join_thread()


def _rank_main(
    rank: int,
    n: int,
    port: int,
    backend: str,
    sizes: list[int],
    budget: float,
    timeout: float,
    results: Any,
) -> None:
    """One rank of the sweep: its samples (rank 0's) or its traceback go to `results`."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor's new names
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=timeout),
            device_id=device if backend == "nccl" else None,
        )
        samples = _measure(rank, n, device, sizes, budget)
        results.put((rank, True, samples if rank == 0 else None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(
    rank: int, n: int, device: Any, sizes: list[int], budget: float
) -> dict[str, list[tuple[float, float]]]:
    """Each collective at each size on this rank: the slowest rank's time per op."""
    import torch
    import torch.distributed as dist

    def agreed(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[str, list[tuple[float, float]]] = {}
    for kind in COLLECTIVES:
        points: list[tuple[float, float]] = []
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            op = _operation(kind, rank, n, numel, device)
            t0 = time.perf_counter()
            try:
                op()
            except (RuntimeError, NotImplementedError):
                # The backend lacks it (an older Gloo's reduce-scatter): refused on every
                # rank alike, before any message.
                points = []
                break
            sync()
            first = agreed(time.perf_counter() - t0)
            count = max(2, min(200, int(budget / max(first, 1e-9))))
            best = math.inf
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(count):
                    op()
                sync()
                best = min(best, (time.perf_counter() - t0) / count)
            seconds = agreed(best)
            points.append((float(numel * 4), seconds / 2 if kind == "send" else seconds))
        if points:
            out[kind] = points
        dist.barrier()
    return out


def _operation(kind: str, rank: int, n: int, numel: int, device: Any) -> Any:
    """One `kind` of a float32 tensor of `numel` elements (the whole tensor: an
    all-gather's output, a reduce-scatter's input); "send" is a round trip between
    ranks 0 and 1 (the others idle): its time is halved."""
    import torch
    import torch.distributed as dist

    whole = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, shard)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, whole)
    if kind == "broadcast":
        return lambda: dist.broadcast(whole, 0)

    def trip() -> None:
        if rank == 0:
            dist.send(whole, 1)
            dist.recv(whole, 1)
        elif rank == 1:
            dist.recv(whole, 0)
            dist.send(whole, 0)

    return trip
