"""The node type a plan is made for: `Hardware` and its two `Link`s (see the package)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "DTYPES", "Hardware", "Host", "Link", "bus_factor"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def bus_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of the tensor in a `kind` collective over n ranks
    (a ring's, NCCL's tests' "bus bandwidth" convention): 2(n-1)/n for an all-reduce,
    (n-1)/n for an all-gather or a reduce-scatter (of the whole tensor), 1 for a
    broadcast or a send."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: a collective of `nbytes` over n ranks takes
    alpha + factor(kind, n) * nbytes / bandwidth seconds, `bandwidth` being the bus
    bandwidth in bytes/s (NCCL's tests' convention, the same at every n): factor is
    2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter (nbytes:
    the whole tensor), 1 for a broadcast or a send (`bus_factor`). `collectives` holds
    a measured (alpha, bandwidth) per collective where a calibration fitted one."""

    alpha: float
    bandwidth: float
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)

    def time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds of one `kind` collective of `nbytes` over `n` ranks (0 for n <= 1)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        alpha, bandwidth = self.collectives.get(kind, (self.alpha, self.bandwidth))
        return alpha + bus_factor(kind, n) * nbytes / bandwidth


@dataclass(frozen=True, slots=True)
class Host:
    """A GPU's share of its host, where CPU offload keeps what the GPU does not: its
    memory, the copies between them, and the host's own elementwise pace (the
    optimizer step runs there)."""

    memory: int
    """Bytes of host memory one device's offloaded state may use (the node's, shared)."""
    bandwidth: float
    """Bytes/s one device copies to or from pinned host memory, each way (its PCIe link)."""
    memory_bandwidth: float
    """Bytes/s an elementwise kernel on the host moves for one device (the CPU's memory
    bandwidth shared by the node's devices)."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """One node type (the package's docstring). Sizes in bytes, rates per second."""

    name: str
    description: str
    device: str
    """"cuda" or "cpu": the device type its ranks train on."""
    memory: int
    """Bytes of one device training may use (on a GPU its memory less the CUDA
    context; on a CPU machine the node's memory, shared by its processes)."""
    devices_per_node: int
    peak_flops: dict[str, float]
    """The datasheet's dense peak FLOP/s by dtype (empty where there is none: a CPU)."""
    flops: dict[str, float]
    """FLOP/s a training step's matmuls achieve, by dtype: measured by a calibration,
    or `efficiency` of the peak in a datasheet profile."""
    memory_bandwidth: float
    """Bytes/s an elementwise kernel moves (reads plus writes)."""
    launch: float
    """Seconds one kernel costs at least (its launch and dispatch): the floor of a
    small model's step."""
    intra: Link
    """Between the devices of one node."""
    inter: Link
    """Between nodes, per device (a node's network shared by its devices)."""
    host: Host | None = None
    """Where CPU offload goes; None: no plan offloads (a CPU machine, or a file without
    a [host] table)."""
    efficiency: float | None = None
    """The fraction of the peak `flops` states, where a datasheet profile assumed it."""
    reserve: float = 0.0
    """What the device's memory allocator holds beyond the allocations at their peak, as
    a fraction of that peak: PyTorch's CUDA caching allocator keeps freed blocks for
    reuse, and a block split for one request and freed is too small or too scattered for
    the next (fragmentation), so a step reserves more than it allocates, and what it
    reserves is what runs out. A plan's peak is what the step allocates (what
    `torch.cuda.max_memory_allocated` counts); a row fits where that peak times
    1 + reserve is within `memory`. 0: a CPU, whose processes share the node's memory."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure comes from ("measured by scaletrain plan --calibrate ..." for
    a calibration)."""
    path: str | None = None
    """The file it was read from."""

    def matmul_flops(self, dtype: str) -> float:
        """Achieved FLOP/s in `dtype`, falling back to fp32's (a CPU without bf16
        kernels); fp8 where the file has none (a calibration measures no float8
        matmul) is bf16's at the datasheet's fp8-to-bf16 ratio (`fp8_flops`)."""
        if dtype == "fp8" and (fp8 := self.fp8_flops()) is not None:
            return fp8
        return self.flops.get(dtype) or self.flops["fp32"]

    def fp8_flops(self) -> float | None:
        """Achieved float8 FLOP/s: the file's, else its bf16 figure times the datasheet's
        fp8 peak over its bf16 peak; None where the device has no float8 matmuls."""
        if "fp8" in self.flops:
            return self.flops["fp8"]
        peaks = self.peak_flops
        if "bf16" in self.flops and peaks.get("fp8") and peaks.get("bf16"):
            return self.flops["bf16"] * peaks["fp8"] / peaks["bf16"]
        return None
