"""Hardware files written (`write`): the TOML that files.py's `load` reads back equal
(the format is files.py's docstring), never replacing a file already there."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.hardware.datasheet import datasheets
from scaletrain.hardware.spec import Hardware, Link

__all__ = ["write"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE.match(key) else _string(key)


def _string(text: str) -> str:
    # JSON's string escapes are TOML's basic string's (\" \\ \n \t \uXXXX); DEL is not
    # allowed raw in TOML, and non-ASCII is written as it is (UTF-8).
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest exact: 1e-05, 989500000000000.0
    return _string(str(value))


def _link_lines(key: str, link: Link) -> list[str]:
    lines = [
        "",
        f"[{key}]",
        f"alpha = {_value(float(link.alpha))}",
        f"bandwidth = {_value(float(link.bandwidth))}",
    ]
    for kind, (alpha, bandwidth) in link.collectives.items():
        lines += [
            "",
            f"[{key}.collectives.{_key(kind)}]",
            f"alpha = {_value(float(alpha))}",
            f"bandwidth = {_value(float(bandwidth))}",
        ]
    return lines


def _text(hw: Hardware) -> str:
    lines = [
        "# A scaletrain hardware file (scaletrain plan --hardware FILE). Units: bytes,",
        "# seconds, FLOP/s; [sources] says where each figure comes from.",
        f"name = {_value(hw.name)}",
        f"description = {_value(hw.description)}",
        f"device = {_value(hw.device)}",
        f"memory = {_value(int(hw.memory))}",
        *([f"reserve = {_value(float(hw.reserve))}"] if hw.reserve else []),
        f"devices_per_node = {_value(int(hw.devices_per_node))}",
    ]
    # The entry with these peaks (H200 SXM's are H100 SXM's: the one its sources name).
    said = hw.sources.get("peaks", "")
    same = [s.name for s in datasheets() if hw.peak_flops and s.peaks == hw.peak_flops]
    entry = next((n for n in same if n in said), same[0] if same else None)
    if entry is not None:
        lines.append(f"peaks = {_value(entry)}")
    if hw.efficiency is not None:
        lines.append(f"efficiency = {_value(float(hw.efficiency))}")
    lines += [
        f"memory_bandwidth = {_value(float(hw.memory_bandwidth))}",
        f"launch = {_value(float(hw.launch))}",
        "",
        "[flops]",
    ]
    lines += [f"{_key(d)} = {_value(float(v))}" for d, v in hw.flops.items()]
    if hw.peak_flops and entry is None:
        lines += ["", "[peak_flops]"]
        lines += [f"{_key(d)} = {_value(float(v))}" for d, v in hw.peak_flops.items()]
    lines += _link_lines("intra", hw.intra) + _link_lines("inter", hw.inter)
    if hw.host is not None:
        lines += [
            "",
            "[host]",
            f"memory = {_value(int(hw.host.memory))}",
            f"bandwidth = {_value(float(hw.host.bandwidth))}",
            f"memory_bandwidth = {_value(float(hw.host.memory_bandwidth))}",
        ]
    lines += ["", "[sources]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in hw.sources.items()]
    return "\n".join(lines) + "\n"


def write(hw: Hardware, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write `hw` as a hardware file at `path` (what `load` reads back equal, but for
    `path`); an existing file is never replaced unless `overwrite` (a calibration
    already saved is not lost). Atomic: a temporary file beside it, renamed."""
    target = Path(path).expanduser()
    if target.exists() and not overwrite:
        raise _exists(target)
    if not target.parent.is_dir():
        raise ConfigError(
            f"cannot write {target}: its directory {target.parent} does not exist. Fix: "
            "create it, or give a path in an existing directory.",
            field="hardware",
        )
    text = _text(hw)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, target)
        else:
            # A link, not a rename: it fails if the file appeared meanwhile, so nothing
            # another process wrote there is replaced either.
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise _exists(target) from None
            except OSError:  # a filesystem without hard links
                os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def _exists(target: Path) -> ConfigError:
    return ConfigError(
        f"{target} exists already; a hardware file is never replaced. Fix: give another "
        "path, or move that file away first.",
        field="hardware",
    )
