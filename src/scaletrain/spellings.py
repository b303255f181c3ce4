"""Other spellings of settings' values, accepted wherever the setting is taken (the
library, a command's flags, a --config file) and turned into the setting's own name
at once, so that everything after sees one name. Imports nothing (the CLI's parser,
which must not import torch, uses it)."""

from __future__ import annotations

from typing import Any

__all__ = ["ALIASES", "canonical"]

ALIASES: dict[str, dict[str, str]] = {
    "precision": {
        "32-true": "32",
        "fp32": "32",
        "bf16": "bf16-mixed",
        "fp16": "fp16-mixed",
        "16-mixed": "fp16-mixed",
    },
}
"""field -> {other spelling: the value's own name}."""


def canonical(field: str, value: Any) -> Any:
    """`value`'s own name for setting `field` (`bf16` for precision: bf16-mixed), else
    `value` unchanged."""
    table = ALIASES.get(field)
    if table is None or not isinstance(value, str):
        return value
    return table.get(value, value)
