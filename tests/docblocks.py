"""The documentation's code blocks, read from the pages so that the text and the tests
cannot drift apart.

A block a test runs has a name on the line above it, `<!-- example: NAME -->`, and the
test reads it by that name; a block no test can run says why instead,
`<!-- not-run: REASON -->` (tests/unit/test_docs_blocks.py holds every block of docs/
and README.md to one of the two). Output shown on a page is a `text` block and needs
neither.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

__all__ = ["DOCS", "README", "ROOT", "Block", "blocks", "commands", "example", "pages"]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_MARK = re.compile(r"<!--\s*(example|not-run):\s*(.*?)\s*-->")


def pages() -> list[Path]:
    """Every page of the site, then the README."""
    return [*sorted(DOCS.rglob("*.md")), README]


@dataclass(frozen=True)
class Block:
    """One code block of a page: where it is, its language, its text and its mark."""

    page: Path
    line: int  # 1-based line of the opening fence (or of an indented block's first line)
    lang: str  # the fence's language ("" when it has none or the block is indented)
    text: str
    mark: str | None  # "example", "not-run" or None
    value: str  # the example's name, or why it is not run

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The code blocks of `page`, fenced or indented, with the mark on the line above."""
    source = page.read_text()
    lines = source.splitlines()
    found = []
    for token in MarkdownIt("commonmark").parse(source):
        if token.type not in ("fence", "code_block") or token.map is None:
            continue
        start = token.map[0]
        above = lines[start - 1].strip() if start > 0 else ""
        mark = _MARK.fullmatch(above)
        lang = token.info.split()[0] if token.type == "fence" and token.info.strip() else ""
        found.append(
            Block(
                page=page,
                line=start + 1,
                lang=lang,
                text=token.content,
                mark=mark.group(1) if mark else None,
                value=mark.group(2) if mark else "",
            )
        )
    return found


def example(name: str) -> str:
    """The text of the block named NAME, wherever in the docs it is."""
    named = [b for page in pages() for b in blocks(page) if (b.mark, b.value) == ("example", name)]
    if not named:
        raise LookupError(f"no page of docs/ or README.md has an example named {name!r}")
    if len(named) > 1:
        raise LookupError(f"example {name!r} is named twice: {[b.where() for b in named]}")
    return named[0].text


def commands(name: str) -> list[list[str]]:
    """The example's commands, one word list per line (comments and blanks skipped)."""
    return [
        shlex.split(line, comments=True)
        for line in example(name).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
