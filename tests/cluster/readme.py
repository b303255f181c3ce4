"""The README's cluster examples, read from README.md so that the text and the tests
cannot drift apart: each is the fenced block after a `<!-- example: NAME -->` line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["README", "commands", "example", "python_block"]

README = Path(__file__).resolve().parents[2] / "README.md"


def example(name: str) -> str:
    """The text of the example block NAME."""
    text = README.read_text()
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w*\n(.*?)```", text, re.S)
    if match is None:
        raise LookupError(f"README.md has no example named {name!r}")
    return match.group(1)


def commands(name: str) -> list[list[str]]:
    """The example's commands, one word list per line (comments and blanks skipped)."""
    return [
        shlex.split(line, comments=True)
        for line in example(name).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def python_block(first_line: str) -> str:
    """A ```python block of the README that starts with `first_line`."""
    text = README.read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if block.startswith(first_line):
            return str(block)
    raise LookupError(f"README.md has no python block starting {first_line!r}")
