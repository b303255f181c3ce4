"""A hardware file of a CPU machine, as `scaletrain plan --calibrate` writes one, made up
here: a test that checks a run against a plan needs some hardware file, and no test but
tests/dist/test_calibrate.py starts the processes a calibration does. A test never reads
the machine's own calibration (in the user's cache), which a fresh clone does not have."""

from __future__ import annotations

from pathlib import Path

from scaletrain.hardware import Hardware, Link, write

__all__ = ["cpu_hardware_file"]


def cpu_hardware_file(path: Path) -> Path:
    """Write the made-up CPU machine's file at `path` (which must not exist) and return it."""
    hw = Hardware(
        name="test-cpu", description="a made-up CPU machine", device="cpu", memory=8 * 2**30,
        devices_per_node=2, peak_flops={}, flops={"fp32": 50e9}, memory_bandwidth=5e9,
        launch=5e-6, intra=Link(50e-6, 2e9), inter=Link(50e-6, 2e9),
    )  # fmt: skip
    write(hw, path)
    return path
