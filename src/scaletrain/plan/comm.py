"""Collectives as alpha-beta costs, and a short probe that measures alpha and beta here.

A ring over N ranks (what NCCL and Gloo use for large tensors) moves, per rank,
2(N-1)/N x bytes for an all-reduce (a reduce-scatter then an all-gather) and (N-1)/N x
bytes for an all-gather or a reduce-scatter (bytes = the whole, unsharded tensor), in
2(N-1) and N-1 messages:

    all_reduce      2(N-1) alpha + 2(N-1)/N bytes / bandwidth
    all_gather      (N-1) alpha  + (N-1)/N bytes / bandwidth
    reduce_scatter  (N-1) alpha  + (N-1)/N bytes / bandwidth
    send            alpha        + bytes / bandwidth

On this machine the probe starts N Gloo processes on loopback, times each collective
at the sizes the plan will use, and fits alpha and bandwidth per collective (least
squares on the formula's own factors), so the model is the measured one at those sizes.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from scaletrain.plan.hardware import Link

__all__ = ["KINDS", "CommModel", "collective_time", "fit_link", "probe"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _factors(kind: str, n: int) -> tuple[float, float]:
    """(messages, bytes moved per byte of the tensor) per rank for `kind` over n ranks."""
    if n <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return float(n - 1), (n - 1) / n
    if kind == "send":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one `kind` of an `nbytes` tensor over `n` ranks on `link`."""
    messages, moved = _factors(kind, n)
    if messages == 0:
        return 0.0
    return messages * link.alpha + moved * nbytes / link.bandwidth


def fit_link(kind: str, n: int, samples: Sequence[tuple[float, float]]) -> Link:
    """The Link whose `collective_time` fits (bytes, seconds) samples best (least squares)."""
    messages, moved = _factors(kind, n)
    xs = [b for b, _ in samples]
    ys = [t for _, t in samples]
    if len(set(xs)) < 2:
        b, t = samples[0]
        return Link(alpha=0.0, bandwidth=moved * b / max(t, 1e-9))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 1e-15)
    intercept = max(0.0, my - slope * mx)
    return Link(alpha=intercept / messages, bandwidth=moved / slope)


@dataclass(slots=True)
class CommModel:
    """Links per (collective, group size): measured here, or one profile's for all."""

    links: dict[tuple[str, int], Link] = field(default_factory=dict)
    default: Link | None = None
    source: str = "measured"
    runtime_bytes: dict[int, int] = field(default_factory=dict)
    """RSS a rank's process group and collectives added (bytes), by group size."""

    def time(self, kind: str, nbytes: float, n: int, link: Link | None = None) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        chosen = link or self.links.get((kind, n)) or self.default
        if chosen is None:
            # Measured at another group size only (a pipeline's 2-rank sends on a 4-process
            # probe): the nearest size's link for this collective.
            sizes = sorted((abs(m - n), m) for k, m in self.links if k == kind)
            chosen = self.links[(kind, sizes[0][1])] if sizes else None
        if chosen is None:
            raise KeyError(f"no link measured for {kind} over {n} ranks")
        return collective_time(kind, nbytes, n, chosen)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _probe_rank(rank: int, n: int, port: int, sizes: list[int], repeats: int, q: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor's new names
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from scaletrain.observe.memory import current_rss_bytes, reset_rss_peak, rss_peak_bytes

    # From before the group: the planner counts this as the group's own memory in a
    # device's total, not in the growth after setup (see estimate.Memory.group).
    reset_rss_peak()
    before = current_rss_bytes() or 0
    dist.init_process_group("gloo", rank=rank, world_size=n)
    out: dict[str, Any] = {k: [] for k in KINDS[:3]}
    try:
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            full = torch.ones(numel)
            shard = torch.ones(numel // n)
            ops: dict[str, Callable[[], Any]] = {
                "all_reduce": partial(dist.all_reduce, full),
                "all_gather": partial(dist.all_gather_into_tensor, full, shard),
                "reduce_scatter": partial(dist.reduce_scatter_tensor, shard, full),
            }
            for kind, op in ops.items():
                op()  # warm-up: connections, buffers
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - t0)
                out[kind].append((float(numel * 4), statistics.median(times)))
        # Beyond the probe's own tensors (the largest size, whole and one shard).
        own = max(sizes) * (1 + 1 / n)
        out["growth"] = max(0, int(rss_peak_bytes() - before - own)) if before else 0
        grown = torch.tensor([out["growth"]], dtype=torch.float64)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        out["growth"] = int(grown.item())
    finally:
        dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def probe(n: int, sizes: Sequence[int], *, repeats: int = 5, timeout: float = 120.0) -> CommModel:
    """Measure Gloo on loopback over `n` processes at `sizes` (bytes); fit each collective.

    Takes a few seconds (starting the processes dominates). Ranks run one thread each.
    """
    import multiprocessing as mp

    model = CommModel(source=f"probe: Gloo over loopback, {n} processes")
    if n <= 1:
        return model
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    chosen = sorted({max(4096, int(s)) for s in sizes})
    if len(chosen) < 2:
        chosen = [chosen[0] // 4 or 4096, *chosen]
    procs = [
        ctx.Process(target=_probe_rank, args=(r, n, port, chosen, repeats, q), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = q.get(timeout=0.5)
                break
            except Exception:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Gloo probe over {n} processes failed (exit codes {failed}) "
                        f"or took over {timeout:.0f} s"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    model.runtime_bytes[n] = int(result.pop("growth"))
    for kind, samples in result.items():
        model.links[(kind, n)] = fit_link(kind, n, samples)
    # A point-to-point send moves the same bytes once: an all-gather between 2 is one.
    model.links[("send", n)] = model.links[("all_gather", n)]
    return model
