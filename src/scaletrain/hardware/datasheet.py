"""The GPUs' datasheet peaks: devices.toml, the one table of them.

Each entry is a GPU's dense peak FLOP/s by dtype (the vendors print the 2:4 sparsity
figures for tensor cores, with an asterisk: those halved), a regular expression on
the lower-cased name the driver reports (first match wins), and the document the
figures come from. A device no entry matches has no datasheet peak at all: never
another device's (torchtitan's fallback to the A100's figure for an unknown device is
how users have seen 563% MFU).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.hardware.spec import DTYPES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover: Python 3.10 (tomli is tomllib's source)
    import tomli as tomllib

__all__ = ["DEVICES_FILE", "Datasheet", "datasheet", "datasheet_peak", "datasheets"]

DEVICES_FILE = Path(__file__).with_name("devices.toml")


@dataclass(frozen=True, slots=True)
class Datasheet:
    """One entry of devices.toml."""

    name: str
    match: str
    """Regular expression on the lower-cased device name (torch.cuda.get_device_name)."""
    source: str
    peaks: dict[str, float]
    """Dense peak FLOP/s by dtype; a dtype the device has no figure for is absent."""


def _entry(i: int, raw: Any) -> Datasheet:
    where = f"{DEVICES_FILE}: [[device]] number {i + 1}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a table")
    for key in ("name", "match", "source"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ValueError(f"{where} has no {key} (a string)")
    peaks: dict[str, float] = {}
    for key, value in raw.items():
        if key in ("name", "match", "source"):
            continue
        if key not in DTYPES:
            raise ValueError(f"{where}: {key} is not a dtype ({', '.join(DTYPES)})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{where}: {key} = {value!r} is not a positive FLOP/s")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {key} = {value!r} is not finite")
        peaks[key] = float(value)
    re.compile(raw["match"])
    return Datasheet(raw["name"], raw["match"], raw["source"], peaks)


@functools.cache
def datasheets() -> tuple[Datasheet, ...]:
    """devices.toml's entries, in the file's order (the order a device name is matched
    in)."""
    with DEVICES_FILE.open("rb") as f:
        data = tomllib.load(f)
    entries = tuple(_entry(i, raw) for i, raw in enumerate(data.get("device", [])))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{DEVICES_FILE}: two entries share a name: {names}")
    return entries


def datasheet(device_name: str) -> Datasheet | None:
    """The entry of the device the driver names `device_name` (the first whose `match`
    is found in it, lower-cased); None for a device the table lacks."""
    name = device_name.lower()
    return next((s for s in datasheets() if re.search(s.match, name)), None)


def datasheet_peak(device_name: str, dtype: str) -> float | None:
    """The datasheet's dense peak FLOP/s for `dtype` on this device; None if the device
    is not in the table or the table has no such dtype for it (never another device's)."""
    sheet = datasheet(device_name)
    return None if sheet is None else sheet.peaks.get(dtype)
