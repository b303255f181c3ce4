"""`scaletrain plan --calibrate`'s measuring: a quick CPU calibration over 2 Gloo
processes writes a hardware file that load() reads; its processes never outlive it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.hardware import COLLECTIVES, load
from scaletrain.hardware.calibrate import CalibrationError, calibrate, sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_quick_cpu_calibration_writes_a_hardware_file(tmp_path: Path) -> None:
    path = tmp_path / "cpu.toml"
    hw = calibrate(path, device="cpu", processes=2, quick=True)
    assert load(path) == hw and hw.path == str(path) and hw.name == "cpu"
    assert hw.device == "cpu" and hw.devices_per_node == 2 and hw.memory > 0
    assert hw.flops["fp32"] > 0 and hw.memory_bandwidth > 0 and 0 < hw.launch < 0.01
    assert hw.peak_flops == {} and hw.efficiency is None
    assert set(hw.intra.collectives) == set(COLLECTIVES)
    for alpha, bandwidth in [(hw.intra.alpha, hw.intra.bandwidth), *hw.intra.collectives.values()]:
        assert alpha > 0 and bandwidth > 0
    for figure in ("flops", "memory", "memory_bandwidth", "launch", "intra"):
        assert hw.sources[figure].startswith("measured by scaletrain plan --calibrate on ")
    assert hw.sources["inter"].startswith("not measured")
    # Measured again to the same path: refused, the first file kept.
    before = path.read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match="exists already"):
        calibrate(path, device="cpu", processes=2, quick=True)
    assert path.read_text(encoding="utf-8") == before


def test_one_process_measures_no_collective_and_says_so(tmp_path: Path) -> None:
    hw = calibrate(tmp_path / "one.toml", device="cpu", processes=1, quick=True)
    assert hw.devices_per_node == 1 and hw.intra.collectives == {}
    assert hw.sources["intra"].startswith("not measured") and "one process" in hw.sources["intra"]
    assert hw.intra.alpha > 0 and hw.intra.bandwidth > 0  # the ethernet profile's, said so
    assert multiprocessing.active_children() == []


def test_a_sweep_past_its_time_is_stopped_and_its_processes_killed() -> None:
    with pytest.raises(CalibrationError, match="did not finish in 1 s; they were stopped"):
        sweep(2, "gloo", [4096], quick=True, timeout=1.0)
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL must fail to start here")
def test_a_failed_rank_is_reported_and_the_others_killed() -> None:
    with pytest.raises(CalibrationError, match=r"process \d \(of 2, nccl\) failed; the others"):
        sweep(2, "nccl", [4096], quick=True, timeout=120)
    assert multiprocessing.active_children() == []
