"""Hardware files: the shipped profiles, the one datasheet table, load's refusals, write."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from scaletrain import hardware
from scaletrain.errors import ConfigError, use_cli_names
from scaletrain.hardware import Hardware, Link, datasheet_peak, load, shipped, write

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FIGURES = ("peaks", "efficiency", "memory", "reserve", "memory_bandwidth", "launch",
           "devices_per_node", "intra", "inter", "host")  # fmt: skip


def test_every_shipped_profile_loads_and_names_the_source_of_each_figure() -> None:
    assert shipped() == ["a100-pcie", "a100-sxm", "b200", "ethernet", "h100-96gb", "h100-sxm",
                         "h200"]  # fmt: skip
    for name in shipped():
        hw = load(name)
        assert hw.name == name and hw.device == "cuda" and hw.devices_per_node == 8
        assert hw.path is not None and Path(hw.path).name == f"{name}.toml"
        assert set(FIGURES) <= set(hw.sources), name
        # Peaks come from devices.toml alone: the file names an entry, copies no number.
        raw = tomllib.loads(Path(hw.path).read_text(encoding="utf-8"))
        assert "peak_flops" not in raw and "flops" not in raw
        assert hw.peak_flops == next(
            s.peaks for s in hardware.datasheets() if s.name == raw["peaks"]
        )
        assert hw.efficiency is not None
        assert hw.flops == {d: hw.efficiency * p for d, p in hw.peak_flops.items()}
        assert 60 * 2**30 < hw.memory < 180 * 2**30
        assert hw.launch == 5e-6 and "assumption" in hw.sources["launch"]
        assert "assumption" in hw.sources["efficiency"]
        # A GPU's caching allocator holds more than a step allocates: rows fit with it.
        assert hw.reserve == 0.15 and "assumption" in hw.sources["reserve"]
        assert "x 0.7" in hw.sources["memory_bandwidth"]
        # Every GPU's host is stated, for CPU offload's rows, with what was assumed.
        assert hw.host is not None and 100e9 <= hw.host.memory <= 300e9
        assert hw.host.bandwidth in (25.6e9, 51.2e9) and "PCIe Gen" in hw.sources["host"]
        assert "x 0.8, an assumption" in hw.sources["host"]


def test_the_profiles_figures_are_their_datasheets() -> None:
    h100 = load("h100-sxm")
    assert h100.peak_flops["bf16"] == 989.5e12 and h100.efficiency == 0.55
    assert h100.matmul_flops("bf16") == pytest.approx(0.55 * 989.5e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12 * 0.7)
    assert (h100.intra.bandwidth, h100.inter.bandwidth) == (450e9, 50e9)
    assert (h100.intra.alpha, h100.inter.alpha) == (5e-6, 10e-6)
    teton = load("h100-96gb")
    assert teton.efficiency == 0.45 and teton.peak_flops == h100.peak_flops
    assert "between" in teton.sources["peaks"] and "NVL" in teton.sources["peaks"]
    assert teton.memory_bandwidth == pytest.approx(2.4e12 * 0.7)
    assert teton.memory > h100.memory
    h200 = load("h200")
    assert h200.peak_flops["fp8"] == 1979e12 and h200.memory > 130 * 2**30
    b200 = load("b200")
    assert b200.peak_flops["bf16"] == 2250e12 and b200.intra.bandwidth == 900e9
    assert b200.memory_bandwidth == pytest.approx(8e12 * 0.7) and b200.memory > h200.memory
    assert load("a100-sxm").efficiency == 0.6 and load("a100-sxm").intra.bandwidth == 300e9
    assert load("a100-pcie").intra.bandwidth == 32e9
    assert load("a100-pcie").inter.bandwidth == pytest.approx(25e9 / 8)
    ethernet = load("ethernet")
    assert ethernet.inter.bandwidth == pytest.approx(12.5e9 / 8)
    assert ethernet.intra == h100.intra and ethernet.peak_flops == h100.peak_flops


def test_the_ledger_reads_the_one_datasheet_table() -> None:
    """One table of GPU peaks: the ledger's MFU imports it from scaletrain.hardware (it
    had its own copy, DATASHEET, beside the planner's)."""
    import scaletrain.observe.metrics.flops as flops

    assert flops.datasheet_peak is hardware.datasheet_peak
    assert not hasattr(flops, "DATASHEET")
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1979e12)
    assert datasheet_peak("NVIDIA H100 NVL", "fp8") == pytest.approx(1670.5e12)
    assert datasheet_peak("NVIDIA L40S", "fp8") == pytest.approx(733e12)
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "fp8") is None
    for sheet in hardware.datasheets():
        # The vendor's document: a datasheet, or the architecture's whitepaper (GeForce).
        assert re.search("datasheet|whitepaper", sheet.source) and "fp32" in sheet.peaks
        re.compile(sheet.match)


def test_every_gpu_float8_names_has_a_float8_peak() -> None:
    """The refusals of --float8 name the GPUs that multiply float8 matrices (FLOAT8_GPUS):
    each has an fp8 datasheet peak, so a run on it has a float8 MFU (RTX 4090 and B200
    had no entry at all). The names are as the driver reports them."""
    from scaletrain.strategies.float8 import FLOAT8_GPUS

    reported = {"RTX 4090": "NVIDIA GeForce RTX 4090", "H100": "NVIDIA H100 80GB HBM3"}
    for gpu in FLOAT8_GPUS.split(", "):
        assert datasheet_peak(reported.get(gpu, f"NVIDIA {gpu}"), "fp8"), gpu
    assert datasheet_peak("NVIDIA B200", "bf16") == pytest.approx(2250e12)
    # A GB200's GPU runs at its own figures, not at a B200's.
    assert datasheet_peak("NVIDIA GB200", "fp8") == pytest.approx(5000e12)
    assert datasheet_peak("NVIDIA GeForce RTX 4090", "bf16") == pytest.approx(165.2e12)
    assert datasheet_peak("NVIDIA GeForce RTX 4090 D", "bf16") is None  # fewer cores
    # A GH200's GPU is named as such, not as the H200 its name holds.
    assert getattr(hardware.datasheet("NVIDIA GH200 480GB"), "name", None) == "gh200"


def _profile(tmp_path: Path, edit: str, old: str | None = None) -> Path:
    """h100-sxm.toml with one line replaced (`old`, a regex, by `edit`) or appended."""
    text = (Path(hardware.__file__).parent / "h100-sxm.toml").read_text(encoding="utf-8")
    if old is None:
        text = edit + "\n" + text
    else:
        text, count = re.subn(old, edit, text, count=1, flags=re.M)
        assert count == 1
    path = tmp_path / "mine.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("old", "edit", "said"),
    [
        (r"^memory = .*$", "", "`memory` is missing; expected the bytes one device may use"),
        (r"^devices_per_node = .*$", "", "`devices_per_node` is missing"),
        (r"^description = .*$", "", "`description` is missing"),
        (r"^launch = .*$", "", "`launch` is missing"),
        (r"^\[intra\]\nalpha = .*\nbandwidth = .*$", "", "`intra` is missing"),
        (r"^bandwidth = 450e9$", "", "`intra.bandwidth` is missing; expected bus bytes/s"),
        (r"^memory = .*$", 'memory = "80GB"', "`memory = '80GB'` is not the bytes one device"),
        (r"^memory = .*$", "memory = 1.5", "`memory = 1.5` is not the bytes one device"),
        (r"^device = .*$", 'device = "tpu"', '`device = \'tpu\'` is not "cuda" or "cpu"'),
        (r"^efficiency = .*$", "efficiency = 1.5", "`efficiency = 1.5` is not a fraction"),
        (r"^efficiency = .*$", "efficiency = true", "`efficiency = True` is not a fraction"),
        (r"^reserve = .*$", "reserve = -0.1", "`reserve = -0.1` is not the allocator's hold"),
        (r"^reserve = .*$", "reserve = 15", "`reserve = 15` is not the allocator's hold"),
        (r"^reserve = .*$", 'reserve = "15%"', "`reserve = '15%'` is not the allocator's hold"),
        (r"^bandwidth = 50e9$", "bandwidth = -1", "`inter.bandwidth = -1` is not bus bytes/s"),
        (r"^peaks = .*$", 'peaks = "h100"', "`peaks = 'h100'` is not an entry"),
        (r"^memory = ", "memroy = ", "`memroy` is not a field of a hardware file"),
        (r"^\[inter\]$", "[inter]\nlatency = 1", "`inter.latency` is not a field of [inter]"),
        (r"^efficiency = .*$", "", "`flops` is missing; expected a [flops] table"),
        (r"^\[host\]$", "[host]\npcie = 1", "`host.pcie` is not a field of [host]"),
        (r"^memory_bandwidth = 3.84e\+10$", "", "`host.memory_bandwidth` is missing"),
        (r"^bandwidth = 5.12e\+10$", "bandwidth = 0", "`host.bandwidth = 0` is not bytes/s"),
        (r"^device = .*$", 'device = "cpu"', '[host] is given for a device = "cpu" machine'),
    ],
)
def test_a_wrong_field_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, old: str, edit: str, said: str
) -> None:
    path = _profile(tmp_path, edit, old)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert said in message and str(path) in message and "Fix:" in message
    assert info.value.field == "hardware"


def test_the_fixes_say_how() -> None:
    """A mistyped key or entry gets the near spelling; an unknown name the shipped list."""
    with pytest.raises(ConfigError) as info:
        load("h100")
    message = str(info.value)
    assert all(name in message for name in shipped())
    assert "Fix: hardware='h100-96gb' or hardware='h100-sxm'." in message
    use_cli_names(True)
    with pytest.raises(ConfigError, match=r"--hardware h2000 is neither .* Fix: --hardware h200\."):
        load("h2000")


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_or_blank_name_is_neither_a_profile_nor_a_file(value: str) -> None:
    """`--hardware ''` said "--hardware : . is a directory": Path("") is the working
    directory."""
    with pytest.raises(ConfigError) as info:
        load(value)
    message = str(info.value)
    assert message.startswith(f"hardware={value!r} is neither a shipped hardware profile nor")
    assert all(name in message for name in shipped())
    use_cli_names(True)
    with pytest.raises(ConfigError, match=f"^--hardware '{value}' is neither a shipped hard"):
        load(value)


def test_a_typo_in_a_file_gets_the_near_spelling(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Fix: write it as `memory`"):
        load(_profile(tmp_path, "memroy = ", r"^memory = "))
    # Inside a table the fix is the key as written there: `host.bandwidth` written in
    # [host] is host.host.bandwidth.
    with pytest.raises(ConfigError, match=r"Fix: write it as `bandwidth` in \[host\]"):
        load(_profile(tmp_path, "bandwith = ", r"^bandwidth = (?=5\.12e\+10)"))
    with pytest.raises(ConfigError, match=r'Fix: write `peaks = "h100-sxm"`\.'):
        load(_profile(tmp_path, 'peaks = "h100-sx"', r"^peaks = .*$"))
    with pytest.raises(
        ConfigError, match=r'Fix: write `peaks = "h200-nvl"` or `peaks = "h200-sxm"`'
    ):
        load(_profile(tmp_path, 'peaks = "h200"', r"^peaks = .*$"))
    # A whole number of bytes written as a float (80e9) is the integer it is.
    assert load(_profile(tmp_path, "memory = 80e9", r"^memory = .*$")).memory == 80 * 10**9


def test_a_file_that_cannot_be_read_is_said_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="there is no file"):
        load(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("memory = = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        load(str(tmp_path) + "/")


def _cpu_machine() -> Hardware:
    """A calibration's kind of file: measured flops, collectives, no datasheet entry."""
    link = Link(3e-4, 7.5e8, {"all_reduce": (3e-4, 7.5e8), "send": (1e-4, 1.5e9)})
    return Hardware(
        name="box", description='a "quoted" CPU — with UTF-8\nand a newline', device="cpu",
        memory=23 * 2**30, devices_per_node=2, peak_flops={"fp32": 1e12, "bf16": 2e12},
        flops={"fp32": 5.1e10, "bf16": 8.9e8}, memory_bandwidth=2.1e10, launch=3.2e-6,
        intra=link, inter=Link(3e-5, 1.25e9), sources={"flops": "measured", "a key": "x\\y"},
    )  # fmt: skip


def test_write_then_load_gives_the_same_hardware(tmp_path: Path) -> None:
    for hw in [_cpu_machine(), *(load(name) for name in shipped())]:
        path = write(hw, tmp_path / f"{hw.name}.toml")
        assert load(path) == dataclasses.replace(hw, path=str(path))
    # A written profile names its devices.toml entry, as the shipped ones do: its own
    # where two have the same peaks (the H200 SXM's are the H100 SXM's).
    assert 'peaks = "h100-sxm"' in (tmp_path / "h100-sxm.toml").read_text(encoding="utf-8")
    assert 'peaks = "h200-sxm"' in (tmp_path / "h200.toml").read_text(encoding="utf-8")
    h200 = hardware.datasheet("NVIDIA H200")
    assert h200 is not None and h200.name == "h200-sxm"
    assert hardware.datasheet("NVIDIA GeForce RTX 9090") is None


def test_write_never_replaces_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text("# a calibration someone saved\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="exists already; a hardware file is never replaced"):
        write(_cpu_machine(), path)
    assert path.read_text(encoding="utf-8") == "# a calibration someone saved\n"
    write(_cpu_machine(), path, overwrite=True)
    assert load(path).name == "box"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml"]  # no temporary left
    with pytest.raises(ConfigError, match="does not exist"):
        write(_cpu_machine(), tmp_path / "no" / "such.toml")


def test_a_links_time_uses_each_collectives_bus_factor() -> None:
    link = Link(1e-5, 1e9)
    assert link.time("all_reduce", 1e9, 4) == pytest.approx(1e-5 + 2 * 3 / 4)
    assert link.time("all_gather", 1e9, 4) == pytest.approx(1e-5 + 3 / 4)
    assert link.time("reduce_scatter", 1e9, 4) == pytest.approx(1e-5 + 3 / 4)
    assert link.time("broadcast", 1e9, 4) == pytest.approx(1e-5 + 1)
    assert link.time("send", 1e9, 2) == pytest.approx(1e-5 + 1)
    assert link.time("all_reduce", 1e9, 1) == 0 and link.time("all_reduce", 0, 8) == 0
    measured = Link(1e-5, 1e9, {"all_gather": (2e-5, 2e9)})
    assert measured.time("all_gather", 1e9, 2) == pytest.approx(2e-5 + 0.5 / 2)
    assert measured.time("all_reduce", 1e9, 2) == pytest.approx(1e-5 + 1)


def test_a_calibration_fit_recovers_alpha_and_bandwidth() -> None:
    from scaletrain.hardware.calibrate import fit

    sizes = [4096 * 4**i for i in range(7)]
    exact = [(b, 50e-6 + 2 * 3 / 4 * b / 2e9) for b in sizes]
    alpha, bandwidth = fit("all_reduce", 4, exact)
    assert alpha == pytest.approx(50e-6) and bandwidth == pytest.approx(2e9)
    # Small messages faster than the line (a protocol switch): alpha stays positive.
    bent = [(b, t * (0.3 if b < 65536 else 1.0)) for b, t in exact]
    alpha, bandwidth = fit("all_reduce", 4, bent)
    assert alpha > 0 and bandwidth > 0
    # No growth with size at all (noise): still a positive, finite pair.
    flat = [(b, 1e-4) for b in sizes]
    alpha, bandwidth = fit("send", 2, flat)
    assert alpha > 0 and 0 < bandwidth < float("inf")


def test_calibrate_refuses_before_it_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scaletrain.hardware.calibrate as calibration

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before refusing")

    monkeypatch.setattr(calibration, "_matmul_flops", no_measuring)
    monkeypatch.setattr(calibration, "sweep", no_measuring)
    saved = tmp_path / "cpu.toml"
    saved.write_text("# saved\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="exists already"):
        calibration.calibrate(saved, device="cpu")
    assert saved.read_text(encoding="utf-8") == "# saved\n"
    with pytest.raises(ConfigError, match="processes=0 is not a number of processes"):
        calibration.calibrate(tmp_path / "new.toml", device="cpu", processes=0)
    with pytest.raises(ConfigError, match="device='tpu' is not a device to calibrate"):
        calibration.calibrate(tmp_path / "new.toml", device="tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            calibration.calibrate(tmp_path / "new.toml", device="cuda")
    assert not (tmp_path / "new.toml").exists()


def test_the_hardware_files_ship_in_the_wheel() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert "*.toml" in config["tool"]["setuptools"]["package-data"]["scaletrain.hardware"]
