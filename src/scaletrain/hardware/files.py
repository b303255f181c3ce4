"""Hardware files: TOML, read (`load`; writing.py writes them, `write`).

A file holds one node type; units are bytes, seconds and FLOP/s:

    name = "h100-sxm"              # optional: the file's name without .toml
    description = "..."
    device = "cuda"                # or "cpu"
    memory = 83860000000           # bytes one device may use
    reserve = 0.15                 # optional: the allocator's hold beyond the peak (0)
    devices_per_node = 8
    peaks = "h100-sxm"             # optional: the devices.toml entry of its datasheet
    efficiency = 0.55              # optional: flops = efficiency x the peaks
    memory_bandwidth = 2.345e12    # bytes/s an elementwise kernel moves
    launch = 5e-6                  # seconds one kernel costs at least
    [flops]                        # achieved FLOP/s by dtype (else efficiency x peaks)
    [peak_flops]                   # a device devices.toml lacks: its datasheet's peaks
    [intra]                        # alpha (s) and bandwidth (bus bytes/s) in a node,
    [intra.collectives.all_reduce] #   and per collective where one was measured
    [inter]                        # the same between nodes, per device
    [host]                         # optional, a GPU's: memory (bytes), bandwidth (bytes/s
                                   #   to or from pinned host memory, each way) and
                                   #   memory_bandwidth (the host's elementwise bytes/s)
    [sources]                      # where each figure comes from

Every field is checked: a file with one missing, mistyped or unknown is refused
naming the file and the field, before any plan is made from it.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, closest, near_fix, say, spell
from scaletrain.hardware.datasheet import datasheets
from scaletrain.hardware.spec import COLLECTIVES, DTYPES, Hardware, Host, Link

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover: Python 3.10 (tomli is tomllib's source)
    import tomli as tomllib

__all__ = ["PROFILES_DIR", "load", "shipped"]

PROFILES_DIR = Path(__file__).parent
"""Where the shipped profiles are: every .toml file here but devices.toml."""

_KEYS = (
    "name", "description", "device", "memory", "reserve", "devices_per_node", "peaks", "efficiency",
    "memory_bandwidth", "launch", "flops", "peak_flops", "intra", "inter", "host", "sources",
)  # fmt: skip
_DEVICES = ("cuda", "cpu")


def shipped() -> list[str]:
    """The names of the profiles scaletrain ships (`load` takes them), sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml") if p.name != "devices.toml")


def _refuse(where: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: {problem}. Fix: {fix}.", field="hardware")


def load(name_or_path: str | os.PathLike[str]) -> Hardware:
    """The hardware a shipped profile's name (`shipped()`) or a .toml file names."""
    value = os.fspath(name_or_path)
    names = shipped()
    if value in names:
        path = PROFILES_DIR / f"{value}.toml"
    else:
        path = Path(value).expanduser()
        # An empty (or blank) value names no file: Path("") is ".", the working directory.
        looks_like_a_path = value.strip() != "" and (
            os.sep in value or value.endswith(".toml") or path.exists()
        )
        if not looks_like_a_path:
            shown = spell("hardware", value)
            if not value.strip():  # `--hardware ` shows no value: `--hardware ''` does
                shown = say(api=shown, cli=f"{spell('hardware')} {shlex.quote(value)}")
            raise ConfigError(
                f"{shown} is neither a shipped hardware profile nor a "
                f"file; expected one of {', '.join(names)}, or the path of a .toml "
                "hardware file (`scaletrain plan --calibrate FILE` writes one for this "
                "machine)." + near_fix("hardware", value, names),
                field="hardware",
            )
    where = spell("hardware", value)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise _refuse(
            where,
            f"there is no file {path}",
            f"give the path of a hardware file, or one of the shipped profiles "
            f"({', '.join(names)})",
        ) from None
    except IsADirectoryError:
        raise _refuse(where, f"{path} is a directory", "give a .toml hardware file") from None
    except OSError as exc:
        raise _refuse(where, f"cannot read {path}: {exc.strerror or exc}", "check it") from None
    except tomllib.TOMLDecodeError as exc:
        raise _refuse(where, f"{path} is not valid TOML ({exc})", "correct that line") from None
    return _parse(data, path, f"{where} ({path})" if str(path) != value else where)


class _Fields:
    """Reads one table's fields, refusing each wrong one in the file's own terms."""

    def __init__(self, data: Mapping[str, Any], where: str, table: str = "") -> None:
        self.data, self.where, self.table = data, where, table

    def _name(self, key: str) -> str:
        return f"{self.table}.{key}" if self.table else key

    def wrong(self, key: str, expected: str, example: str) -> ConfigError:
        """`example`: a line (`memory = 8e10`), or a phrase that quotes its own (a table)."""
        name = self._name(key)
        shown = example if "`" in example else f"`{example}`"
        if key not in self.data:
            return _refuse(self.where, f"`{name}` is missing; expected {expected}", f"add {shown}")
        return _refuse(
            self.where, f"`{name} = {self.data[key]!r}` is not {expected}", f"write it as {shown}"
        )

    def number(
        self,
        key: str,
        expected: str,
        example: str,
        *,
        positive: bool = True,
        most: float = math.inf,
    ) -> float:
        value: Any = self.data.get(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            ok = False
        if not ok or value > most:
            raise self.wrong(key, expected, example)
        return float(value)

    def integer(self, key: str, expected: str, example: str) -> int:
        value: Any = self.data.get(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # memory = 80e9
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.wrong(key, expected, example)
        return value

    def text(self, key: str, expected: str, example: str, choices: tuple[str, ...] = ()) -> str:
        value = self.data.get(key)
        if not isinstance(value, str) or not value or (choices and value not in choices):
            raise self.wrong(key, expected, example)
        return value

    def table_of(self, key: str, expected: str, example: str) -> dict[str, Any]:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            raise self.wrong(key, expected, example)
        return value

    def only(self, allowed: tuple[str, ...], what: str) -> None:
        for key in self.data:
            if key not in allowed:
                near = closest(key, allowed)
                raise _refuse(
                    self.where,
                    f"`{self._name(key)}` is not a field of {what}; expected {', '.join(allowed)}",
                    (f"write it as `{near[0]}`" + (f" in [{self.table}]" if self.table else ""))
                    if near
                    else "remove it",
                )


def _rates(fields: _Fields, key: str, what: str) -> dict[str, float]:
    """A [flops] or [peak_flops] table: positive FLOP/s by dtype."""
    table = fields.table_of(
        key, f"a table of {what} by dtype", f"a `[{key}]` table with lines such as `fp32 = 6.7e13`"
    )
    rates = _Fields(table, fields.where, key)
    rates.only(DTYPES, f"[{key}] (dtypes)")
    return {d: rates.number(d, f"{what} (a positive number)", f"{d} = 6.7e13") for d in table}


def _link(fields: _Fields, key: str) -> Link:
    if not isinstance(fields.data.get(key), dict):
        raise fields.wrong(
            key,
            "a table with alpha and bandwidth",
            f"an `[{key}]` table with `alpha = 1e-5` and `bandwidth = 5e10`",
        )
    link = _Fields(fields.data[key], fields.where, key)
    link.only(("alpha", "bandwidth", "collectives"), f"[{key}]")
    alpha = link.number(
        "alpha", "seconds per message (a number >= 0)", "alpha = 1e-5", positive=False
    )
    bandwidth = link.number("bandwidth", "bus bytes/s (a positive number)", "bandwidth = 5e10")
    kinds = _Fields(
        link.table_of(
            "collectives",
            "a table of collectives",
            f"a `[{key}.collectives.all_reduce]` table with `alpha` and `bandwidth`",
        ),
        fields.where,
        f"{key}.collectives",
    )
    kinds.only(COLLECTIVES, "the collectives")
    collectives: dict[str, tuple[float, float]] = {}
    for kind in kinds.data:
        table = kinds.table_of(
            kind,
            "a table with alpha and bandwidth",
            f"a `[{key}.collectives.{kind}]` table with `alpha` and `bandwidth`",
        )
        one = _Fields(table, fields.where, f"{key}.collectives.{kind}")
        one.only(("alpha", "bandwidth"), f"[{key}.collectives.{kind}]")
        collectives[kind] = (
            one.number("alpha", "seconds (a number >= 0)", "alpha = 1e-5", positive=False),
            one.number("bandwidth", "bus bytes/s (a positive number)", "bandwidth = 5e10"),
        )
    return Link(alpha, bandwidth, collectives)


def _host(fields: _Fields, device: str) -> Host | None:
    if "host" not in fields.data:
        return None
    example = (
        "a `[host]` table with `memory = 2.7e11`, `bandwidth = 5e10` and `memory_bandwidth = 4e10`"
    )
    if device != "cuda":
        raise _refuse(
            fields.where,
            '[host] is given for a device = "cpu" machine, whose memory is the host\'s already',
            "remove the [host] table",
        )
    host = _Fields(fields.table_of("host", "a table", example), fields.where, "host")
    host.only(("memory", "bandwidth", "memory_bandwidth"), "[host]")
    return Host(
        memory=host.integer(
            "memory", "the host bytes one device may use (a positive integer)", "memory = 2.7e11"
        ),
        bandwidth=host.number(
            "bandwidth", "bytes/s to or from the host (a positive number)", "bandwidth = 5e10"
        ),
        memory_bandwidth=host.number(
            "memory_bandwidth",
            "the bytes/s the host's elementwise kernels move (a positive number)",
            "memory_bandwidth = 4e10",
        ),
    )


def _entry_fix(entry: object, names: list[str]) -> str:
    """`peaks = "h100-sxm"` for a near spelling; all that `entry` begins, if several."""
    starts = [n for n in names if isinstance(entry, str) and entry and n.startswith(entry)]
    near = starts or closest(entry, names)
    if not near:
        return "name one of them, or give the device's peaks in a [peak_flops] table instead"
    return "write " + " or ".join(f'`peaks = "{n}"`' for n in near)


def _parse(data: dict[str, Any], path: Path, where: str) -> Hardware:
    fields = _Fields(data, where)
    fields.only(_KEYS, "a hardware file")
    name = (
        fields.text("name", "a name (a string)", f'name = "{path.stem}"')
        if "name" in data
        else path.stem
    )
    description = fields.text(
        "description",
        "a line saying what it is (a string)",
        'description = "8x H100 SXM5 80GB per node"',
    )
    device = fields.text("device", '"cuda" or "cpu"', 'device = "cuda"', _DEVICES)
    memory = fields.integer(
        "memory", "the bytes one device may use (a positive integer)", "memory = 83860000000"
    )
    reserve = (
        fields.number(
            "reserve",
            "the allocator's hold beyond the step's peak, a fraction of it in [0, 1]",
            "reserve = 0.15",
            positive=False,
            most=1.0,
        )
        if "reserve" in data
        else 0.0
    )
    per_node = fields.integer(
        "devices_per_node", "the devices of one node (an integer >= 1)", "devices_per_node = 8"
    )
    sheets = {s.name: s for s in datasheets()}
    peak_flops: dict[str, float] = {}
    if "peaks" in data:
        entry = data["peaks"]
        if not isinstance(entry, str) or entry not in sheets:
            raise _refuse(
                where,
                f"`peaks = {entry!r}` is not an entry of scaletrain's devices.toml; expected "
                f"one of {', '.join(sheets)}",
                _entry_fix(entry, list(sheets)),
            )
        peak_flops = dict(sheets[entry].peaks)
        if "peak_flops" in data:
            raise _refuse(
                where,
                "both `peaks` and [peak_flops] give the datasheet's peaks",
                "keep one of them",
            )
    elif "peak_flops" in data:
        peak_flops = _rates(fields, "peak_flops", "the datasheet's dense peak FLOP/s")
    efficiency = (
        fields.number(
            "efficiency",
            "a fraction of the peak (a number in (0, 1])",
            "efficiency = 0.5",
            most=1.0,
        )
        if "efficiency" in data
        else None
    )
    if "flops" in data:
        flops = _rates(fields, "flops", "achieved FLOP/s")
    elif efficiency is not None and peak_flops:
        flops = {d: efficiency * peak for d, peak in peak_flops.items()}
    elif efficiency is not None:
        raise _refuse(
            where,
            "`efficiency` is given but no datasheet peaks to take it of",
            'add `peaks = "h100-sxm"` (an entry of devices.toml) or [peak_flops]',
        )
    else:
        raise fields.wrong(
            "flops",
            "a [flops] table of achieved FLOP/s by dtype, or an "
            "`efficiency` of the datasheet's peaks",
            "a `[flops]` table with lines such as `fp32 = 6.7e13`",
        )
    if "fp32" not in flops:
        raise _refuse(
            where,
            "no fp32 figure among the achieved FLOP/s (the one every other dtype falls back to)",
            "add `fp32 = ...` to [flops] (or to the peaks)",
        )
    bandwidth = fields.number(
        "memory_bandwidth",
        "the bytes/s an elementwise kernel moves (a positive number)",
        "memory_bandwidth = 2.3e12",
    )
    launch = fields.number(
        "launch",
        "the seconds one kernel costs at least (a number >= 0)",
        "launch = 5e-6",
        positive=False,
    )
    intra = _link(fields, "intra")
    inter = _link(fields, "inter")
    host = _host(fields, device)
    table = fields.table_of(
        "sources",
        "a table of where each figure comes from",
        'a `[sources]` table with lines such as `memory = "the datasheet"`',
    )
    sources = _Fields(table, where, "sources")
    for key in table:
        sources.text(key, "a string", f'{key} = "where it comes from"')
    return Hardware(
        name=name, description=description, device=device, memory=memory, reserve=reserve,
        devices_per_node=per_node, peak_flops=peak_flops, flops=flops,
        memory_bandwidth=bandwidth, launch=launch, intra=intra, inter=inter, host=host,
        efficiency=efficiency, sources=dict(table), path=str(path),
    )  # fmt: skip
