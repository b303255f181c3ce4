"""The probe: N Gloo processes on this machine measure the CommModel the plan uses.

On this machine the probe starts N Gloo processes on loopback, times each collective
at the sizes the plan will use (the gradients', and a pipeline's activations per
microbatch; a send as half a round trip between two of them), back to back and as a
step reaches it (every rank coming from work), and fits alpha and bandwidth per
collective (least squares on the formula's own factors), so the model is the measured
one at those sizes.

The same processes measure what ranks sharing this machine cost each other, which
the quiet collectives do not show (scaletrain.plan.crowd: a pipeline's hop as a stage
makes it, a collective reached from work, the model's step side by side, the RSS of
its fully sharded steps, the CPU of its tensor-parallel step among them).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from scaletrain.plan.children import ctrl_c_held
from scaletrain.plan.comm import KINDS, CommModel, fit_link
from scaletrain.plan.crowd import (
    STAGE_HOPS,
    STRATEGY_STEPS,
    from_work,
    mean_time,
    meeting_cost,
    side_by_side,
    stage_hop,
    step_growth,
)
from scaletrain.plan.hardware import usable_cores

__all__ = ["PROBE_BUDGET", "STRATEGY_STEPS", "probe"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PROBE_BUDGET = 0.25
"""Seconds the probe spends on one collective at one size, about (at least 3 of it)."""


def _agreed_count(op: Callable[[], Any], most: int) -> int:
    """Run `op` once (a warm-up: connections, buffers) and agree on how many of it fit
    PROBE_BUDGET, between 3 and `most`: every rank the same, the slowest rank's. A
    large model's 400 MB all-reduce runs 3 times, not 20, within the probe's timeout."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    op()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return max(3, min(most, int(PROBE_BUDGET / max(took.item(), 1e-9))))


def _point_to_point(
    rank: int, sizes: list[int], count: int
) -> tuple[list[tuple[float, float]], float]:
    """(bytes, seconds) of one send from rank 0 to rank 1 at each size: half a round
    trip (0 sends, 1 receives and sends it back), the mean of `count`; the other ranks
    wait in the barriers. A pipeline stage's sends are these: one peer, one message.
    Priced as an all-gather between 2 instead, they were 3x too slow here at 2
    processes (190-300 us against 60-110 at 50-260 KB) and 10-20x at 4, where a
    collective waits for all 4 ranks to get one of 2 cores.

    Also the CPU seconds a send or a receive costs its process (rank 0's over the
    trips, per message, at the sizes' median): Gloo's threads, the system calls, the
    wake-ups."""
    import torch
    import torch.distributed as dist

    out: list[tuple[float, float]] = []
    cpu: list[float] = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4))

        def trip(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        trips = _agreed_count(trip, count)
        c0 = time.process_time()
        out.append((float(buf.numel() * 4), mean_time(trip, trips) / 2))
        cpu.append((time.process_time() - c0) / trips / 2)
        dist.barrier()  # the others waited for the pair
    return out, statistics.median(cpu)


def _rank_start(port: int) -> None:
    """A probe rank's process before its group: one thread, Gloo on loopback at `port`."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor's new names
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def _probe_rank(
    rank: int,
    n: int,
    port: int,
    q: Any,
    sizes: list[int],
    repeats: int,
    work: bytes | None = None,
    cores: int = 1,
    hop_sizes: list[int] | None = None,
    collectives: dict[str, list[tuple[str, int]]] | None = None,
) -> None:
    import torch
    import torch.distributed as dist

    _rank_start(port)
    from scaletrain.observe.memory import current_rss_bytes, reset_rss_peak, rss_peak_bytes

    # From before the group: the planner counts this as the group's own memory in a
    # device's total, not in the growth after setup (see estimate.Memory.group).
    reset_rss_peak()
    before = current_rss_bytes() or 0
    dist.init_process_group("gloo", rank=rank, world_size=n)
    out: dict[str, Any] = {k: [] for k in KINDS[:3]}
    busy: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS[:3]}
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
                count = _agreed_count(op, repeats)
                out[kind].append((float(numel * 4), mean_time(op, count)))
                busy[kind].append((float(numel * 4), from_work(op, count)))
        # Beyond the probe's own tensors (the largest size, whole and one shard).
        own = max(sizes) * (1 + 1 / n)
        out["growth"] = max(0, int(rss_peak_bytes() - before - own)) if before else 0
        grown = torch.tensor([out["growth"]], dtype=torch.float64)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        out["growth"] = int(grown.item())
        out["busy"] = busy
        # After the memory measurements: its buffers would be theirs to reuse.
        out["send"], out["send_cpu"] = _point_to_point(rank, sizes, repeats)
        if hop_sizes:
            hops = stage_hop(rank, hop_sizes, STAGE_HOPS)
            # The receiver measured: rank 1's samples, to rank 0, which reports.
            gathered: list[Any] = [None] * n
            dist.all_gather_object(gathered, hops)
            out["stage_hop"] = gathered[1]
        out["meeting"] = meeting_cost(rank, cores)
        if work is not None:
            out["concurrency"] = side_by_side(rank, work, cores)
    finally:
        dist.destroy_process_group()
    _report(rank, q, out)


def _report(rank: int, q: Any, out: dict[str, Any]) -> None:
    """Rank 0's result to the parent; every rank then gone."""
    if rank == 0:
        q.put(out)
        q.close()
        q.join_thread()  # the result is in the pipe before this process goes
    # Gone without the interpreter's exit: its C++ static destructors at exit met a
    # thread still joinable in about 1 of 4 probes over 4 processes ("terminate called
    # without an active exception" on the user's terminal, the rank aborted).
    os._exit(0)


def _strategy_rank(
    rank: int,
    n: int,
    port: int,
    q: Any,
    strategy: str,
    work: bytes,
    collectives: list[tuple[str, int]],
) -> None:
    """A strategy's steps (`work`, pickled: FSDP's or tensor parallel's) among `n` fresh
    ranks: the RSS they add and their CPU (crowd.step_growth), as `strategy` and
    `strategy`_cpu. Fresh processes: after other steps the allocator reuses what those
    freed. The gpt recipe's tensor-parallel steps at 4 ranks grew 1.8 MiB after the
    probe's fully sharded and plain steps, 22 MiB after `malloc_trim`, 37-39 in fresh
    processes; its FSDP steps 53 MiB after the probe's collectives, 58-61 fresh (at 2
    ranks: 53, and 63-66). Their runs: 37-39, 61-62 and 62-63."""
    import torch.distributed as dist

    _rank_start(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    out: dict[str, Any] = {}
    try:
        out[strategy], out[f"{strategy}_cpu"] = step_growth(work, collectives)
    finally:
        dist.destroy_process_group()
    _report(rank, q, out)


def _ranks(
    n: int,
    deadline: float,
    timeout: float,
    target: Callable[..., None],
    *args: Any,
) -> dict[str, Any]:
    """`target(rank, n, port, queue, *args)` in `n` fresh processes: rank 0's result;
    the ranks killed on Ctrl-C, a failed rank or `deadline`."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, n, port, q, *args), daemon=True) for r in range(n)]
    try:
        with ctrl_c_held():  # Ctrl-C is the planner's: it kills the ranks (plan/children.py)
            for p in procs:
                p.start()
        while True:
            try:
                result: dict[str, Any] = q.get(timeout=0.5)
                return result
            except Exception:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Gloo probe over {n} processes failed (exit codes {failed}) "
                        f"or took over {timeout:.0f} s"
                    ) from None
    finally:
        # Every rank killed before any is waited for: with rank 0's result here they
        # have nothing left to do, and otherwise (Ctrl-C, a rank failed) the others
        # would wait in a collective. Joined first, a Ctrl-C during a join left the
        # ranks after it running, waiting for ranks that were gone.
        started = [p for p in procs if p.pid is not None]  # not: Ctrl-C came first
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=10)


def probe(
    n: int,
    sizes: Sequence[int],
    *,
    repeats: int = 20,
    timeout: float = 120.0,
    work: Callable[[], Callable[[], Any]] | None = None,
    sharded: Callable[[], Callable[[], Any]] | None = None,
    hop_sizes: Sequence[int] = (),
    tensored: Callable[[], Callable[[], Any]] | None = None,
    collectives: Mapping[str, Sequence[tuple[str, int]]] | None = None,
    batch: int | None = None,
) -> CommModel:
    """Measure Gloo on loopback over `n` processes at `sizes` (bytes); fit each collective
    (the mean of up to `repeats` back to back per size, as many as fit PROBE_BUDGET) and
    a send between two of them; at `hop_sizes` (a pipeline's sends, bytes), a hop
    between two stages as a stage makes it (`stage_hop`; none without them).

    `work` returns the model's training step; given it, the ranks also measure
    `Concurrency` (nothing where it does not pickle, or does not load or run in the
    ranks). `sharded` likewise returns the model's step fully sharded over the ranks'
    group: given it, n fresh ranks measure the RSS its steps add
    (`CommModel.step_growth`) and its CPU among them (`CommModel.step_cpu`), less that
    of its `collectives` ({"fsdp": [(kind, bytes), ...], "tensor": ...}: each one in a
    step). `tensored` likewise, the model's step tensor-parallel over the group. Takes a few seconds (starting the processes dominates);
    `timeout` should leave room for a few dozen of the model's steps, and
    STRATEGY_STEPS of each strategy's on every rank at once. `batch`: the samples per
    rank the steps given run (`CommModel.batch`).
    Ranks run one thread each.
    """
    import pickle

    def packed_or_none(f: Callable[[], Callable[[], Any]] | None) -> bytes | None:
        try:
            return pickle.dumps(f) if f is not None else None
        except Exception:
            return None

    packed, packed_sharded = packed_or_none(work), packed_or_none(sharded)
    packed_tensored = packed_or_none(tensored) if packed is not None else None
    model = CommModel(source=f"probe: Gloo over loopback, {n} processes", batch=batch)
    if n <= 1:
        return model
    chosen = sorted({max(4096, int(s)) for s in sizes})
    if len(chosen) < 2:
        chosen = [chosen[0] // 4 or 4096, *chosen]
    each = {k: [(kind, int(b)) for kind, b in v] for k, v in (collectives or {}).items()}
    deadline = time.monotonic() + timeout
    sends = sorted({max(8, int(s)) for s in hop_sizes or ()})
    result = _ranks(
        n, deadline, timeout, _probe_rank, chosen, repeats, packed, usable_cores(), sends, each
    )
    for strategy, steps in (("fsdp", packed_sharded), ("tensor", packed_tensored)):
        if steps is not None:
            took = _ranks(
                n, deadline, timeout, _strategy_rank, strategy, steps, each.get(strategy, [])
            )
            result.update(took)
    model.runtime_bytes[n] = int(result.pop("growth"))
    model.send_cpu[n] = float(result.pop("send_cpu"))
    hops = result.pop("stage_hop", None)
    if hops:
        model.stage_hop[n] = fit_link("send", 2, hops)
    model.meeting[n] = float(result.pop("meeting"))
    for strategy in ("fsdp", "tensor"):
        grown = result.pop(strategy, None)
        if grown is not None:
            model.step_growth[(strategy, n)] = int(grown)
    side = result.pop("concurrency", None)
    if side is not None:
        model.concurrency[n] = side
    for kind, samples in result.pop("busy").items():
        model.busy[(kind, n)] = fit_link(kind, n, samples)
    for strategy in ("fsdp", "tensor"):
        crowded = result.pop(f"{strategy}_cpu", None)
        if crowded is not None:
            model.step_cpu[(strategy, n)] = crowded
    for kind, samples in result.items():
        model.links[(kind, n)] = fit_link(kind, n, samples)
    return model
