"""Errors a user can cause around the ledger and the profile window, in the interface's words;
NVML read through a fake module."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import scaletrain as st
from scaletrain.errors import use_cli_names
from scaletrain.observe.metrics.attach import create_ledger
from scaletrain.observe.metrics.ledger import LedgerConfig, StepLedger
from scaletrain.observe.metrics.memory import MemorySampler
from scaletrain.observe.metrics.profiling import arm_profile, parse_steps
from scaletrain.train.config import TrainConfig


@pytest.mark.parametrize("value", ["x", "5-2", "0-3", "10-"])
def test_profile_steps_are_checked_in_the_librarys_words(value: str) -> None:
    with pytest.raises(st.ConfigError, match=f"profile={value!r}: expected a window of steps"):
        parse_steps(value)


def test_profile_steps_are_checked_in_the_commands_words() -> None:
    use_cli_names()
    with pytest.raises(
        st.ConfigError, match="--profile 5-2: expected .* Fix: pass e.g. --profile 10-15"
    ):
        TrainConfig(profile="5-2")
    with pytest.raises(st.ConfigError, match="at most 50"):
        TrainConfig(profile="1-80")
    with pytest.raises(
        st.ConfigError, match="--profile 1-3 needs the step ledger, which --no-ledger"
    ):
        TrainConfig(profile="1-3", ledger=False)
    with pytest.raises(st.ConfigError, match="--ledger-every 0"):
        TrainConfig(ledger_every=0)
    assert parse_steps("12") == (12, 12) and parse_steps((3, 4)) == (3, 4)


def test_rt_profile_needs_a_ledger_and_a_place_for_its_traces(tmp_path: Path) -> None:
    with pytest.raises(st.ConfigError, match=r"rt.profile\(\) needs the step ledger"):
        arm_profile(None, "2-3", None, rank=0, world_size=1)
    ledger = StepLedger(LedgerConfig(flops=False))
    with pytest.raises(st.ConfigError, match="nowhere to write its traces"):
        arm_profile(ledger, "2-3", None, rank=0, world_size=1)
    ledger.closed = 5
    with pytest.raises(st.ConfigError, match="already at step 5.*profile='6-7'"):
        arm_profile(ledger, "2-3", tmp_path, rank=0, world_size=1)
    window = arm_profile(ledger, "6-7", tmp_path, rank=0, world_size=1)
    assert window.out == tmp_path / "traces" and ledger.profile is window


def test_ledger_settings_are_checked() -> None:
    common: dict[str, Any] = dict(
        rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
        backend="gloo", peer_group=0, precision="32", gather=None,
    )  # fmt: skip
    with pytest.raises(st.ConfigError, match="every=0"):
        create_ledger(LedgerConfig(every=0), **common)
    with pytest.raises(st.ConfigError, match="ledger='yes' is not a ledger setting"):
        create_ledger("yes", **common)  # type: ignore[arg-type]
    assert create_ledger(False, **common) is None
    ledger = create_ledger(True, **common)
    assert ledger is not None and ledger.out is None


def test_gpu_utilisation_comes_from_nvml_matched_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: SimpleNamespace(uuid="1234-abcd", pci_bus_id="0000:01:00.0"),
    )
    calls: list[str] = []

    class FakeNvml:
        def nvmlInit(self) -> None:
            calls.append("init")

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
            calls.append(uuid)
            return "handle"

        def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
            assert handle == "handle"
            return SimpleNamespace(gpu=87, memory=12)

    sampler = MemorySampler(torch.device("cuda", 0), nvml=FakeNvml())
    assert sampler.gpu_util() == 87.0
    assert calls == ["init", "GPU-1234-abcd"]


def test_without_nvml_utilisation_is_unknown_not_zero() -> None:
    class Broken:
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    sampler = MemorySampler(torch.device("cuda", 0), nvml=Broken())
    assert sampler.gpu_util() is None
    assert MemorySampler(torch.device("cpu")).sample().rss_peak > 0
