"""Devices and links the planner knows: datasheet profiles, and this machine.

Figures are the vendors' datasheet peaks (dense, no sparsity), per GPU and per
direction:

- H100 SXM5 80GB: FP32 67 TFLOP/s, BF16 989 TFLOP/s, 80 GB HBM3; NVLink 4 900 GB/s
  total = 450 GB/s each way (https://www.nvidia.com/en-us/data-center/h100/). DGX H100:
  8x ConnectX-7 400 Gb/s NDR InfiniBand per node, one per GPU = 50 GB/s each
  (https://www.nvidia.com/en-us/data-center/dgx-h100/).
- A100 SXM4 80GB: FP32 19.5 TFLOP/s, BF16 312 TFLOP/s, 80 GB HBM2e; NVLink 3 600 GB/s
  total = 300 GB/s each way (https://www.nvidia.com/en-us/data-center/a100/). DGX A100:
  8x 200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU.
- A100 80GB PCIe: the same FLOP/s; GPUs talk over PCIe Gen4 x16, 64 GB/s total = 32
  GB/s each way (same datasheet); nodes over one 200 Gb/s HDR port = 25 GB/s per node.
- Ethernet cluster: H100 SXM nodes (NVLink inside) joined by one 100 GbE port per node
  = 12.5 GB/s (IEEE 802.3 100GBASE).

Latencies (alpha) are not on datasheets; the values below are assumptions of the
usual order (NCCL's small-message latency: a few microseconds over NVLink, ~10 us over
InfiniBand, tens over TCP) and are printed as such. Achieved bandwidth and FLOP/s are
below the peaks: `compute_efficiency` (the fraction of peak a training step reaches,
MFU) is an assumption too, printed with every plan that uses a profile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["PROFILES", "Hardware", "Link", "this_gpu", "this_machine", "usable_cores"]

GB = 1e9


@dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: `alpha` seconds per message, `bandwidth` bytes/s each way."""

    alpha: float
    bandwidth: float


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    description: str
    device_memory: int
    """Bytes one device offers to training (the profile's memory less 1 GiB for the
    CUDA context and the allocator's slack)."""
    peak_flops: dict[str, float]
    """FLOP/s by precision name ("32", "bf16-mixed", "bf16-true", "fp16-mixed")."""
    intra: Link
    """Between devices of one node."""
    inter: Link
    """Between nodes, per device (the node's NICs shared by its devices)."""
    devices_per_node: int = 8
    compute_efficiency: float = 0.4
    """Fraction of peak FLOP/s a training step reaches (an assumption, see the module)."""
    cores: int | None = None
    """CPU cores the processes share (this machine only: more processes than cores
    run in turns)."""
    source: str = "datasheet"


def _gpu(
    name: str, description: str, fp32: float, bf16: float, intra: Link, inter: Link
) -> Hardware:
    flops = {"32": fp32, "bf16-mixed": bf16, "bf16-true": bf16, "fp16-mixed": bf16}
    return Hardware(
        name=name,
        description=description,
        device_memory=80 * 10**9 - 2**30,
        peak_flops=flops,
        intra=intra,
        inter=inter,
    )


PROFILES: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu(
            "h100-sxm", "8x H100 SXM5 80GB per node, NVLink 4, 400 Gb/s NDR InfiniBand per GPU",
            67e12, 989e12, Link(5e-6, 450 * GB), Link(10e-6, 50 * GB),
        ),
        _gpu(
            "a100-sxm", "8x A100 SXM4 80GB per node, NVLink 3, 200 Gb/s HDR InfiniBand per GPU",
            19.5e12, 312e12, Link(5e-6, 300 * GB), Link(10e-6, 25 * GB),
        ),
        _gpu(
            "a100-pcie", "8x A100 80GB PCIe per node, PCIe Gen4 x16, one 200 Gb/s HDR port per node",
            19.5e12, 312e12, Link(10e-6, 32 * GB), Link(10e-6, 25 * GB / 8),
        ),
        _gpu(
            "ethernet", "8x H100 SXM5 80GB per node, NVLink 4, one 100 GbE port per node",
            67e12, 989e12, Link(5e-6, 450 * GB), Link(30e-6, 12.5 * GB / 8),
        ),
    )
}  # fmt: skip


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def this_machine(devices: int) -> Hardware:
    """This CPU machine: processes share its cores and its available memory.

    FLOP/s and links are measured later (calibration and probe); the numbers here
    are placeholders the estimate never reads for this profile.
    """
    cores = usable_cores()
    return Hardware(
        name="this-machine",
        description=f"this machine: CPU, {cores} cores, Gloo over loopback",
        device_memory=_available_memory() // max(1, devices),
        peak_flops={},
        intra=Link(0.0, 1.0),
        inter=Link(0.0, 1.0),
        devices_per_node=max(1, devices),
        compute_efficiency=1.0,
        cores=cores,
        source="measured",
    )


def this_gpu(device: object) -> Hardware:
    """This machine's GPU (a torch.device of type cuda): its memory is read, its speed
    measured later (the calibration); one device, so no links are used."""
    import torch

    props = torch.cuda.get_device_properties(device)  # type: ignore[arg-type]
    return Hardware(
        name="this-gpu",
        description=f"this machine: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA",
        device_memory=int(props.total_memory) - 2**30,
        peak_flops={},
        intra=Link(0.0, 1.0),
        inter=Link(0.0, 1.0),
        devices_per_node=1,
        compute_efficiency=1.0,
        source="measured",
    )
