"""`scaletrain plan --calibrate FILE`: measure this machine once, write its hardware file.

In this process, on one device (on a CPU with one thread: a CPU rank trains with one,
the launcher sets OMP_NUM_THREADS=1):

- matmul FLOP/s for each dtype the device runs (fp32 and bf16 on a CPU; fp32, tf32,
  bf16, fp16, and fp8 where the GPU has it), through the ledger's own benchmark
  (hardware.measure.matmul_flops), at a few sizes: the best, which a step's large
  matmuls reach and its small ones do not (the planner counts those by `launch`);
- the elementwise memory bandwidth: a large add and a large copy, bytes read and
  written over the time, the best;
- the launch floor: a one-element add run in batches (synchronized after each batch
  on a GPU), the median per op.

Over `processes` ranks of this node, an alpha-beta sweep of each collective
(hardware.sweep, which starts and ends their processes). The fits are the intra-node
link; the inter-node link is given the same figures, and its source says that no
network between nodes was measured. One process measures no collective; its file
says so.

It sits with the facts it measures, below the planner, which starts no process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.cachedir import cache_dir
from scaletrain.errors import ConfigError, spell
from scaletrain.hardware import (
    COLLECTIVES,
    Hardware,
    Host,
    Link,
    datasheet,
    load,
    write,
)
from scaletrain.hardware.sweep import (
    SWEEP_TIMEOUT,
    CalibrationError,
    fit,
    message_sizes,
    sweep,
)

__all__ = [
    "SWEEP_TIMEOUT", "CalibrationError", "calibrate", "calibrated_path", "fit", "load_calibrated",
    "sweep",
]  # fmt: skip

KiB, MiB, GiB = 2**10, 2**20, 2**30


def calibrated_path() -> Path:
    """Where `scaletrain plan --calibrate` keeps this machine's file by default."""
    return cache_dir() / "hardware" / f"{socket.gethostname()}.toml"


def load_calibrated(paper: bool = True) -> Hardware:
    """This machine's calibration (`calibrated_path`), refused where it has none, with
    the fix of planning on paper where that is one (`paper`: not for checking a run,
    which takes the hardware of the machine it trained on)."""
    mine = calibrated_path()
    if not mine.is_file():
        other = (
            f"or plan on paper with {spell('hardware', 'h100-sxm')} (or a file of your own)"
            if paper
            else f"or {spell('hardware', 'FILE')}, the hardware file of the machine the run trained on"
        )
        raise ConfigError(
            f"no {spell('hardware')} given, and this machine has no calibration ({mine}). "
            f"Fix: {spell('calibrate')} once to measure it (about a minute), {other}.",
            field="hardware",
        )
    return load(str(mine))


def calibrate(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    processes: int | None = None,
    quick: bool = False,
    overwrite: bool = False,
) -> Hardware:
    """Measure this machine (module docstring) and write its hardware file at `path`
    (never over an existing one unless `overwrite`); return what `load` reads back.

    `device`: "cpu", "cuda" or "cuda:N" (default: a GPU if there is one). `processes`:
    the ranks of the collective sweep (default: the GPUs of this node, or 2 on a CPU).
    `quick`: fewer sizes and shorter timings."""
    target = Path(path).expanduser()
    _check_target(target, overwrite)
    import torch

    dev = _device(device)
    cuda = dev.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    n = _processes(processes, cuda, gpus)
    stamp = (
        f"measured by scaletrain plan --calibrate on {socket.gethostname()}, "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}"
    )
    name = torch.cuda.get_device_name(dev) if cuda else _cpu_name()
    sources: dict[str, str] = {}
    with _one_thread(not cuda):
        flops, note = _matmul_flops(dev, name, quick)
        sources["flops"] = f"{stamp}: {note}"
        bandwidth = _memory_bandwidth(dev, quick)
        sources["memory_bandwidth"] = (
            f"{stamp}: the best of a large add and a large copy, bytes read and written "
            "over the time"
        )
        launch = _launch_floor(dev, quick)
        sources["launch"] = f"{stamp}: the median time of a one-element add, run in batches"
    host = None
    if cuda:
        host = _host(dev, gpus, quick)
        sources["host"] = (
            f"{stamp}: memory: MemAvailable of /proc/meminfo over the GPUs; bandwidth: the "
            "slower way of a pinned copy to and from the GPU; memory_bandwidth: the CPU's "
            "large add and copy on a GPU's share of its cores"
        )
        torch.cuda.empty_cache()  # the benchmarks' blocks, before the sweep's ranks start
    if cuda:
        memory = int(torch.cuda.get_device_properties(dev).total_memory) - GiB
        sources["memory"] = f"{stamp}: the GPU's total memory less 1 GiB for the CUDA context"
        shipped = load("h100-sxm")  # a step's fragmentation is its own: not measured here
        reserve = shipped.reserve
        sources["reserve"] = (
            f"not measured: the shipped GPU profiles' ({shipped.sources['reserve']})"
        )
        per_node = gpus
        sources["devices_per_node"] = f"{stamp}: the GPUs torch sees on this node"
    else:
        memory, reserve = _available_memory(), 0.0
        sources["memory"] = f"{stamp}: MemAvailable of /proc/meminfo, shared by the processes"
        per_node = n
        sources["devices_per_node"] = f"{stamp}: the processes of the sweep"
    sheet = datasheet(name) if cuda else None
    if sheet is not None:
        sources["peaks"] = f"devices.toml's {sheet.name} entry: {sheet.source}"
    if n >= 2:
        backend = "nccl" if cuda else "gloo"
        samples = sweep(n, backend, message_sizes(cuda, quick), quick=quick)
        fits = {kind: fit(kind, n, points) for kind, points in samples.items()}
        headline = fits.get("all_reduce") or next(iter(fits.values()))
        intra = Link(headline[0], headline[1], fits)
        inter = intra
        sizes = sorted({b for points in samples.values() for b, _ in points})
        over = f"{n} ranks ({backend}{' over loopback' if not cuda else ''})"
        sources["intra"] = (
            f"{stamp}: {', '.join(samples)} over {over}, {_size(sizes[0])} to "
            f"{_size(sizes[-1])}; alpha and bandwidth fitted per collective (least squares "
            "on relative error); the link's own figures are the all-reduce's"
        )
        missing = [k for k in COLLECTIVES if k not in samples]
        if missing:
            sources["intra"] += f"; {', '.join(missing)} not measured: {backend} lacks it"
        sources["inter"] = (
            "not measured: the figures are this node's (intra); no network between nodes "
            "was measured. Replace them with your network's for plans over several nodes"
        )
    else:
        ethernet = load("ethernet").inter
        intra = inter = Link(ethernet.alpha, ethernet.bandwidth)
        sources["intra"] = sources["inter"] = (
            f"not measured: {stamp} with one process, so no collective ran (more "
            "processes measure them); assumed: the shipped ethernet profile's inter-node "
            f"link (one 100 GbE port per 8 GPUs: alpha {ethernet.alpha * 1e6:.0f} us, "
            f"{ethernet.bandwidth / 1e9:.4g} GB/s per device)"
        )
    if cuda:
        description = f"{per_node}x {name} per node, measured ({n} ranks, NCCL)"
    else:
        description = f"this machine's CPU ({name}), {n} processes of one thread, Gloo"
    hw = Hardware(
        name=target.stem, description=description, device="cuda" if cuda else "cpu",
        memory=memory, reserve=reserve, devices_per_node=per_node, flops=flops,
        peak_flops=dict(sheet.peaks) if sheet is not None else {},
        memory_bandwidth=bandwidth, launch=launch, intra=intra, inter=inter, host=host,
        sources=sources,
    )  # fmt: skip
    write(hw, target, overwrite=overwrite)
    return load(target)


def _check_target(target: Path, overwrite: bool) -> None:
    """Refuse a path `write` would refuse, before minutes of measuring."""
    if target.exists() and not overwrite:
        raise ConfigError(
            f"{target} exists already; a calibration never replaces a file. Fix: give "
            "another path, or move that file away first.",
            field="hardware",
        )
    if not target.parent.is_dir():
        raise ConfigError(
            f"cannot write {target}: its directory {target.parent} does not exist. Fix: "
            "create it, or give a path in an existing directory.",
            field="hardware",
        )


def _device(device: str | None) -> Any:
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{spell('device', device)} is not a device to calibrate; expected cpu, cuda "
            "or cuda:N.",
            field="device",
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{spell('device', device)}: this machine has no CUDA GPU torch can use "
                f"(torch {torch.__version__}). Fix: calibrate its CPU "
                f"({spell('device', 'cpu')}), or run on the GPU machine.",
                field="device",
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{spell('device', device)}: this machine has {torch.cuda.device_count()} "
                f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}.",
                field="device",
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _processes(processes: int | None, cuda: bool, gpus: int) -> int:
    if processes is None:
        return gpus if cuda else 2
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(
            f"{spell('processes', processes)} is not a number of processes; expected an "
            "integer >= 1 (1 measures no collective).",
            field="processes",
        )
    if cuda and processes > gpus:
        raise ConfigError(
            f"{spell('processes', processes)}: this node has {gpus} GPU(s), one process "
            f"each. Fix: {spell('processes', gpus)}.",
            field="processes",
        )
    return processes


@contextlib.contextmanager
def _one_thread(on: bool) -> Iterator[None]:
    import torch

    if not on:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def _available_memory() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _size(nbytes: float) -> str:
    return f"{int(nbytes) // MiB} MiB" if nbytes >= MiB else f"{int(nbytes) // KiB} KiB"


def _matmul_flops(dev: Any, name: str, quick: bool) -> tuple[dict[str, float], str]:
    """Achieved FLOP/s by dtype, the best over a few square sizes; and how."""
    import torch

    from scaletrain.hardware.measure import matmul_flops

    cuda = dev.type == "cuda"
    if cuda:
        sizes, seconds = ((4096, 8192), 0.1) if quick else ((2048, 4096, 8192), 0.2)
        major_minor = torch.cuda.get_device_capability(dev)
        dtypes = ["fp32", "fp16"]
        if major_minor >= (8, 0):
            dtypes += ["tf32", "bf16"]
        if major_minor >= (8, 9) and hasattr(torch, "float8_e4m3fn"):
            dtypes.append("fp8")
    else:
        sizes, seconds = ((256, 512), 0.1) if quick else ((256, 512, 1024), 0.25)
        dtypes = ["fp32", "bf16"]
    flops: dict[str, float] = {}
    skipped: list[str] = []
    for dtype in dtypes:
        best = 0.0
        try:
            for n in sizes:
                # matmul_flops runs at least 6 matmuls: a size that slow (bf16 on a CPU
                # without bf16 kernels) says nothing the smaller ones did not.
                if best and 6 * 2 * n**3 / best > max(1.0, 4 * seconds):
                    break
                best = max(best, matmul_flops(dev, dtype, seconds=seconds, size=n))
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as exc:
            if dtype == "fp32":
                raise
            first = (str(exc).splitlines() or [""])[0][:120]
            skipped.append(f"{dtype} ({type(exc).__name__}: {first})")
            continue
        flops[dtype] = best
    note = (
        f"square matmuls of side {', '.join(map(str, sizes))} for ~{seconds} s each (a "
        "size that would take over a second left out), the best size's FLOP/s "
        f"({'one thread' if not cuda else name})"
    )
    if skipped:
        note += f"; not measured: {'; '.join(skipped)}"
    return flops, note


def _sync(dev: Any) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _memory_bandwidth(dev: Any, quick: bool) -> float:
    """Bytes/s of a large add (2 read, 1 written) and a copy (1 and 1), the best."""
    import torch

    cuda = dev.type == "cuda"
    nbytes = (256 if quick else 512) * MiB if cuda else (16 if quick else 64) * MiB
    a = torch.ones(nbytes // 4, device=dev)
    b = torch.ones_like(a)
    c = torch.empty_like(a)
    best = 0.0
    reps = 5 if quick else 10
    for moved, op in (
        (3 * nbytes, lambda: torch.add(a, b, out=c)),
        (2 * nbytes, lambda: c.copy_(a)),
    ):
        op()
        _sync(dev)
        for _ in range(reps):
            t0 = time.perf_counter()
            op()
            _sync(dev)
            best = max(best, moved / max(time.perf_counter() - t0, 1e-9))
    return best


def _host(dev: Any, gpus: int, quick: bool) -> Host:
    """A GPU's share of its host (hardware.Host): pinned copies each way, the slower
    kept; MemAvailable over the GPUs; the CPU's elementwise bandwidth at a GPU's share
    of its cores (the threads an offloaded optimizer step has)."""
    import torch

    share = _available_memory() // max(1, gpus)  # before the pinned buffer, kept cached
    nbytes = (256 if quick else 1024) * MiB
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ways = []
    for dst, src in ((on_gpu, pinned), (pinned, on_gpu)):
        times = []
        for _ in range(4 if quick else 8):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        ways.append(nbytes / min(times[1:]))
    del pinned, on_gpu
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, gpus)))
    try:
        cpu = _memory_bandwidth(torch.device("cpu"), quick)
    finally:
        torch.set_num_threads(threads)
    return Host(memory=share, bandwidth=min(ways), memory_bandwidth=cpu)


def _launch_floor(dev: Any, quick: bool) -> float:
    """Seconds per op of a one-element add, batched (a GPU synchronized per batch)."""
    import torch

    x = torch.zeros(1, device=dev)
    batch, times = 100, []
    for _ in range(2):
        x.add_(1)
    _sync(dev)
    for _ in range(10 if quick else 30):
        t0 = time.perf_counter()
        for _ in range(batch):
            x.add_(1)
        _sync(dev)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)
