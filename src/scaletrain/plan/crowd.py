"""What ranks sharing this machine cost each other, measured inside the probe's Gloo
processes (scaletrain.plan.probe), which the quiet collectives do not show:

- a pipeline's hop as a stage makes it (`stage_hop`): one rank sends and goes on
  computing, the others compute, and the receiver's clock says when the data came
  (the same clock: one machine). With more ranks than cores the hop waits for cores
  at both ends; see stage_hop;
- each collective at each size reached from work (`from_work`), as a step reaches it
  (below, for a one-element all-reduce);
- a collective reached from work (`meeting`): every core is busy up to it, so its
  threads wait to be scheduled and the ranks arrive apart. Here (2 cores), against a
  quiet one's mean: 0-0.4 ms more at 2 processes, 0-1.2 ms at 4; the gpt recipe's FSDP
  and tensor-parallel steps hold 16-30 such collectives.
- given the model's step (`work`), the step side by side against alone, in turns
  (`Concurrency`): the CPU it takes (x1.00-1.17 here: the shared caches and memory),
  and how much one rank's step varies, which synchronous ranks wait for. Timed one
  run after the other instead, the drift of this machine (the same 1-process run
  took 20 to 32 ms a step within minutes) looked like a 15-35% slowdown.
- given the model's step fully sharded over their group, or tensor-parallel over it,
  the RSS 20 such steps add and the CPU the work between their collectives takes
  among them (`step_growth`): on a CPU most of an FSDP run's growth is freed memory
  glibc keeps, which no accounting of the tensors predicts, and DTensor's dispatch and
  FSDP's copies run on caches the other ranks left cold at every collective (tensor
  parallel's x1.6-1.8 its CPU alone here at 4 ranks on 2 cores).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from scaletrain.plan.comm import Concurrency

__all__ = [
    "STAGE_HOPS",
    "STAGE_WORK",
    "STRATEGY_STEPS",
    "from_work",
    "mean_time",
    "meeting_cost",
    "side_by_side",
    "stage_hop",
    "step_growth",
]


def mean_time(op: Callable[[], Any], count: int) -> float:
    """Mean seconds of `op` run `count` times back to back, from one barrier.

    The mean, not a median: on this machine a collective's time is bimodal (a 117 KB
    all-reduce between 2 processes: 200-600 us, or 2-4 ms when a rank's wake-up is
    late, a third of the time), so a median of a few flips between the modes from
    probe to probe (alpha 0.2-1.1 ms), while a step pays their mean."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        op()
    return (time.perf_counter() - t0) / count


def from_work(op: Callable[[], Any], count: int, seconds: float | None = None) -> float:
    """Mean seconds of `op` (a blocking collective) when every rank comes to it from
    `seconds` of work (default STAGE_WORK), as a step's collectives are reached; the
    work timed by the thread's own CPU clock, so that waiting for a core does not
    shorten it.

    On this machine that is what a step's collectives cost, not their quiet time back
    to back: the collective's threads wait for a core, the ranks arrive apart, and its
    caller's caches are cold. Measured (convnet recipe's FSDP units, 52 KB, 2 ranks, 2
    ms of work): an all-gather 1.0-1.6 ms where back to back it took 0.3-0.9, a
    reduce-scatter 1.8-2.9 against 1.0-2.1; at 4 ranks and 400 KB, 4.9-6.1 against
    3.7-4.0 and 6.8-7.2 against 5.5-6.1. A one-element all-reduce (meeting_cost)
    showed 0-0.6 ms of it; FSDP's rows at 2 processes read 16-29% short."""
    import torch
    import torch.distributed as dist

    a = torch.ones(96, 96)
    work = STAGE_WORK if seconds is None else seconds
    took: list[float] = []
    dist.barrier()
    for _ in range(count):
        end = time.thread_time() + work
        while time.thread_time() < end:
            torch.mm(a, a)
        t0 = time.perf_counter()
        op()
        took.append(time.perf_counter() - t0)
    return statistics.fmean(took)


def _timed_steps(step: Callable[[], Any], seconds: float) -> list[tuple[float, float]]:
    """(CPU, wall) seconds of each step, for about `seconds` and at least 5 steps (a
    turn's median is then not one of 3)."""
    out: list[tuple[float, float]] = []
    end = time.perf_counter() + seconds
    while len(out) < 5 or time.perf_counter() < end:
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        out.append((time.process_time() - c0, time.perf_counter() - w0))
    return out


def _loaded(work: bytes, warm_up: int = 0) -> Callable[[], Any] | None:
    """The step a pickled factory builds, run `warm_up` times; None where it fails (the
    training's to explain: no measurement)."""
    import pickle

    try:
        step = pickle.loads(work)()
        for _ in range(warm_up):
            step()
    except Exception:
        return None
    return step


def _every_rank(ready: bool) -> bool:
    """Whether every rank is ready: a measurement on every rank or on none, so that all
    reach the same collectives (each rank calls this at the same point)."""
    import torch
    import torch.distributed as dist

    ok = torch.tensor([1 if ready else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def side_by_side(rank: int, work: bytes, cores: int, turns: int = 2) -> Concurrency | None:
    """Rank 0 steps alone, then with the ranks below `cores` beside it, in turns (a
    drift of the machine hits both); the others wait in a barrier (blocked, not
    spinning). The spread pools every busy rank's steps, each over its own median in
    its turn: a drift of the machine that slows every rank alike makes no rank wait.

    `work` is pickled: a factory that cannot be loaded here (one defined in a
    notebook's __main__) or a step that raises gives no measurement, on every rank
    alike (so that all reach the same collectives), instead of failing the probe."""
    import torch.distributed as dist

    busy = min(dist.get_world_size(), cores)
    # Warmed up twice: the allocator, the optimizer's state.
    step = _loaded(work, warm_up=2) if rank < busy else None
    if not _every_rank(step is not None or rank >= busy) or busy < 2:
        return None
    alone: list[float] = []
    cpu: list[float] = []
    spread: list[float] = []
    failed = False

    def timed() -> list[tuple[float, float]]:
        nonlocal failed
        if step is None or failed:
            return []
        try:
            return _timed_steps(step, 0.4)
        except Exception:  # every rank still meets the barriers below
            failed = True
            return []

    for _ in range(turns):
        dist.barrier()
        if rank == 0:
            alone += [c for c, _ in timed()]
        dist.barrier()
        steps = timed()
        if steps:
            cpu += [c for c, _ in steps]
            mid = statistics.median(w for _, w in steps)
            spread += [w / mid for _, w in steps]
        dist.barrier()
    pooled: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, None if failed else spread)
    if rank != 0 or not alone or any(x is None for x in pooled):
        return None
    one = statistics.median(alone)
    factor = statistics.median(cpu) / max(one, 1e-9)
    spread_all = tuple(sorted(x for r in pooled if r for x in r))
    return Concurrency(busy, max(1.0, factor), spread_all, alone=one)


STRATEGY_STEPS = 20
"""Steps of a strategy's own step (FSDP's, tensor parallel's) whose RSS growth and CPU
the probe measures."""


def step_growth(
    work: bytes, collectives: list[tuple[str, int]] | None = None, steps: int = STRATEGY_STEPS
) -> tuple[int | None, float | None]:
    """RSS a parallel step (`work`, pickled: the model's step fully sharded or
    tensor-parallel over the probe's group; every rank steps) adds over `steps` steps
    after its setup, on the largest rank, and the CPU its main thread spends on a step
    among the ranks, over the second half of the steps, less what its `collectives`
    ((kind, bytes) of each in a step) cost the calling thread when quiet: the work
    between the collectives, as this crowd of ranks makes it (the median over the
    ranks). (None, None) where it does not load or run: on every rank alike.

    The growth is not predictable from the model on a CPU: glibc's allocator keeps much
    of the memory FSDP frees at every unit (gathered parameters, unsharded gradients),
    and how much depends on the sizes and order of those buffers. Measured here (the
    gpt recipe widened to 256, 2 ranks): a step's end held 122-164 MiB, 35 MiB once
    `malloc_trim` returned what was free; DDP's same model 106-114. It creeps for a
    while: the gpt recipe's sharded steps at 2 ranks grew 53-60 MiB in 10 steps, 61 in
    20 (a 20-step run of the training runtime: 64), 65-68 in 40. Tensor parallel's
    too: the gpt recipe's at 4 ranks grew 37-39 MiB in 20 steps, its runs 37-39, where
    counting its tensors made 32.

    The CPU is not a count of the work alone times the contention of plain steps side
    by side: each blocking collective switches a rank out and another in, and the work
    after it runs on cold caches. DTensor's dispatch (Python, op by op) and FSDP's
    copies around each unit lose far more to that than a plain model's products.
    Measured here (gpt recipe, batch 8, tensor parallel over 4 ranks on 2 cores, 24
    all-reduces a step): a rank's work took 31-34 ms of CPU alone (on torch's fake
    process group, its shards at their real shapes) and 51-60 ms among the 4, its
    collectives' own CPU aside; the same shards with real all-reduces of the same size
    at the same points took 52, and with no collective (4 ranks side by side) 38. A
    plain model's step broken by 72 all-reduces lost 0.21-0.26 ms to each, this step
    0.8 to each. The convnet recipe's FSDP step at 2 ranks (8 collectives): 14-17 ms,
    where the count of its work and FSDP's machinery on one rank made 10."""
    import torch
    import torch.distributed as dist

    from scaletrain.observe.memory import current_rss_bytes, reset_rss_peak, rss_peak_bytes

    step = _loaded(work)
    start = current_rss_bytes() if step is not None and reset_rss_peak() else None
    # Every rank steps, or none: a rank that could not would leave the others waiting
    # in the steps' all-gathers. (A step failing on some ranks only still would.)
    if not _every_rank(step is not None and bool(start)) or step is None or not start:
        return None, None
    grown, cpu = -1.0, -1.0
    try:
        for _ in range(steps - steps // 2):
            step()
        c0 = time.thread_time()
        for _ in range(steps // 2):
            step()
        cpu = (time.thread_time() - c0) / max(1, steps // 2)
        grown = float(rss_peak_bytes() - start)
    except Exception:  # the model's own error, on every rank alike
        grown = -1.0
    del step
    out = torch.tensor([grown, -grown], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the largest rank, and any failure
    if -out[1].item() < 0:
        return None, None
    return int(out[0].item()), _less_callers(cpu, collectives or [])


def _less_callers(cpu: float, collectives: list[tuple[str, int]]) -> float | None:
    """`cpu` (a rank's; < 0: its step failed) less what `collectives` cost the calling
    thread back to back, the median over the ranks (each calls this at the same
    point); None where any rank's step failed."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    callers = 0.0
    for kind, size in sorted(set(collectives)):
        numel = max(n, size // 4 // n * n)
        full, shard = torch.ones(numel), torch.ones(numel // n)
        ops: dict[str, Callable[[], Any]] = {
            "all_reduce": partial(dist.all_reduce, full),
            "all_gather": partial(dist.all_gather_into_tensor, full, shard),
            "reduce_scatter": partial(dist.reduce_scatter_tensor, shard, full),
        }
        op = ops[kind]
        op()
        dist.barrier()
        c0 = time.thread_time()
        for _ in range(10):
            op()
        callers += (time.thread_time() - c0) / 10 * collectives.count((kind, size))
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, cpu - callers if cpu >= 0 else None)
    if any(x is None for x in gathered):
        return None
    median = statistics.median(gathered)
    return median if median > 0 else None  # no work left: nothing a row could use


def meeting_cost(rank: int, cores: int, turns: int = 3, meetings: int = 20) -> float:
    """Seconds a collective costs when the ranks come to it from work, beyond the work
    and what the quiet collective costs (which the alpha-beta fit holds).

    On a CPU the ranks' cores are busy up to the collective; the collective's threads
    then wait to be scheduled, and the ranks arrive apart. Measured: every rank runs
    a ~2 ms piece of work then a one-element all-reduce, `meetings` times; against
    rank 0's piece alone (taking turns for a core when there are more ranks than
    cores) and the quiet all-reduce, back to back, in `turns` turns. Means, as the
    links' are (a step pays the mean; a collective's time here is bimodal): medians
    of a few made this 0.03-1.3 ms at 2 ranks from probe to probe."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    a = torch.ones(96, 96)
    tiny = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    count = torch.tensor([max(1.0, 0.002 / max((time.perf_counter() - t0) / 20, 1e-7))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank the same piece

    def piece() -> None:
        for _ in range(int(count.item())):
            torch.mm(a, a)

    def meet() -> None:
        piece()
        dist.all_reduce(tiny)

    alone: list[float] = []
    quiet: list[float] = []
    loaded: list[float] = []
    piece()
    dist.all_reduce(tiny)
    for _ in range(turns):
        dist.barrier()
        if rank == 0:
            w0 = time.perf_counter()
            for _ in range(5):
                piece()
            alone.append((time.perf_counter() - w0) / 5)
        quiet.append(mean_time(partial(dist.all_reduce, tiny), meetings))
        loaded.append(mean_time(meet, meetings))
    if rank != 0:
        return 0.0
    turns_for_a_core = max(1.0, n / cores)
    return max(
        0.0,
        statistics.fmean(loaded)
        - statistics.fmean(alone) * turns_for_a_core
        - statistics.fmean(quiet),
    )


STAGE_WORK = 0.002
"""Seconds of work a stage goes on with after each send in stage_hop (about a recipe
stage's forward or backward of a microbatch here: 1-3 ms)."""
STAGE_HOPS = 60
"""Hops stage_hop times at each size (about 0.2 s at 4 processes here): the mean of 20
moved 0.9-2.7 ms from probe to probe, of 60 1.0-2.3, a hop's time being mostly how
long a core takes to come free."""


def _compute_until_told(source: int, a: Any) -> None:
    """Multiply `a` by itself until `source` sends a word (heard by a listener thread:
    Gloo's receive blocks)."""
    import threading

    import torch
    import torch.distributed as dist

    told = threading.Event()

    def listen() -> None:
        try:
            dist.recv(torch.zeros(1), source)
        finally:  # a peer gone (the receive raised) must not leave this rank spinning
            told.set()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    while not told.is_set():
        torch.mm(a, a)
    listener.join()


def stage_hop(rank: int, sizes: list[int], count: int) -> list[tuple[float, float]]:
    """(bytes, seconds) of a pipeline's hop from rank 0 to rank 1 at each size, as a
    stage makes it: rank 0 sends and goes on with STAGE_WORK of work (the stage's next
    action) while the ranks beyond 1 keep computing (the other stages), and rank 1
    reads, on the machine's monotonic clock, how long after the send the data came;
    the mean of `count` after a few to warm up, each acknowledged before the next.

    Measured so because a quiet send is not what a stage's send costs where the ranks
    outnumber the cores: here (2 cores), a 64 KB hop took 0.05-0.2 ms quiet, and with
    the sender and the others computing 0.2-0.3 ms at 2 processes, 0.6-0.9 at 3 and
    0.9-2.3 at 4 (its I/O and its receiver's wake-up each wait for a core). The gpt
    recipe's 4-stage pipeline, its hops priced as quiet sends, read 30-32% short in
    5-round runs; priced so, -10% (and -21% in a 3-round run)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    a = torch.ones(96, 96)

    def work(seconds: float) -> None:
        end = time.thread_time() + seconds  # the CPU's seconds: waiting does not count
        while time.thread_time() < end:
            torch.mm(a, a)

    out: list[tuple[float, float]] = []
    ack = torch.zeros(1)
    for size in sizes:
        dist.barrier()
        if rank >= 2:
            _compute_until_told(0, a)  # the other stages
            continue
        # float64: the send's time in its first element, to the microsecond.
        buf = torch.zeros(max(1, size // 8), dtype=torch.float64)
        took: list[float] = []
        for i in range(count + 3):
            if rank == 0:
                buf[0] = time.perf_counter()
                sent = dist.isend(buf, 1)
                work(STAGE_WORK)
                if sent is not None:
                    sent.wait()
                dist.recv(ack, 1)
            else:
                dist.recv(buf, 0)
                if i >= 3:
                    took.append(time.perf_counter() - float(buf[0].item()))
                dist.send(ack, 0)
        if rank == 0:
            for other in range(2, n):
                dist.send(torch.zeros(1), other)
        else:
            out.append((float(buf.numel() * 8), statistics.fmean(took)))
    return out
