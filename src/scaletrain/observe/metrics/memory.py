"""Peak memory per rank and GPU utilisation, read without synchronising anything.

CUDA: torch's allocator counters (`max_memory_allocated`, `max_memory_reserved`: host
side, no GPU sync), restarted when rt.setup attaches the ledger (observe/metrics/attach.py).
Every device: the process's peak resident set size (getrusage).
GPU utilisation: NVML (`pip install nvidia-ml-py`), where it is installed and a GPU is
there; the device is matched by UUID, so CUDA_VISIBLE_DEVICES remappings are followed.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MemorySample",
    "MemorySampler",
    "current_rss_bytes",
    "reset_rss_peak",
    "rss_peak_bytes",
]


@dataclass(frozen=True, slots=True)
class MemorySample:
    allocated_peak: int | None
    reserved_peak: int | None
    rss_peak: int
    gpu_util: float | None


def current_rss_bytes() -> int | None:
    """The process's resident set size now (Linux /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize()


def reset_rss_peak() -> bool:
    """Start the process's peak RSS (VmHWM, getrusage's ru_maxrss) again from its RSS
    now (Linux: /proc/self/clear_refs); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_peak_bytes() -> int:
    """The process's peak RSS: VmHWM on Linux (restarted by `reset_rss_peak`), else
    getrusage's ru_maxrss. Not ru_maxrss on Linux: after fork and exec it never drops
    below the parent's RSS at the fork, so a small child of a large parent would report
    the parent's size."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemorySampler:
    """Samples this rank's memory; `nvml` may be given (tests pass a fake module)."""

    def __init__(self, device: Any, nvml: Any = None) -> None:
        self.device = device
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._nvml = None
        self._handle = None
        if self.cuda:
            self._open_nvml(nvml)

    def _open_nvml(self, nvml: Any) -> None:
        try:
            if nvml is None:
                import importlib

                nvml = importlib.import_module("pynvml")  # the nvidia-ml-py package
            nvml.nvmlInit()
            handle = None
            uuid = self._device_uuid()
            if uuid is not None:
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                except Exception:
                    handle = None
            if handle is None:
                import torch

                index = self.device.index if self.device.index is not None else 0
                bus = torch.cuda.get_device_properties(index).pci_bus_id  # type: ignore[attr-defined]
                handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
            self._nvml, self._handle = nvml, handle
        except Exception:
            # No NVML here (not installed, no driver access): utilisation stays unknown.
            self._nvml = self._handle = None

    def _device_uuid(self) -> str | None:
        try:
            import torch

            index = self.device.index if self.device.index is not None else 0
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            return None
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def gpu_util(self) -> float | None:
        if self._nvml is None:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            return None

    def sample(self) -> MemorySample:
        allocated = reserved = None
        if self.cuda:
            import torch

            allocated = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
        return MemorySample(allocated, reserved, rss_peak_bytes(), self.gpu_util())
