"""MkDocs hook: the command-line reference page, rendered from the CLI's own parsers.

The page `cli.md` holds the line `<!-- scaletrain-cli -->`; at build time it becomes one
section per command and subcommand with exactly what `scaletrain CMD --help` prints, so
the reference can never drift from the flags. The help is produced by this checkout's
code (`src/`, not whatever scaletrain is installed) in a child process, at a fixed width
so that a build does not depend on the terminal it runs in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "on_page_markdown", "render", "usage"]

MARKER = "<!-- scaletrain-cli -->"
ROOT = Path(__file__).resolve().parents[2]
WIDTH = "80"

# Walks the parser `scaletrain` builds, depth first: every command and subcommand with
# its --help text. Building the parser imports no torch.
_WALK = """
import argparse, json
from scaletrain.cli import build_parser

def walk(parser, path):
    yield path, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])

print(json.dumps(list(walk(build_parser(), ["scaletrain"]))))
"""


def usage() -> list[tuple[list[str], str]]:
    """[(["scaletrain", "train"], its --help text), ...] for every command."""
    env = {**os.environ, "COLUMNS": WIDTH, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", _WALK],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rendering the CLI's --help failed:\n{done.stderr}")
    return [(list(path), str(text)) for path, text in json.loads(done.stdout)]


def render() -> str:
    """Markdown: a heading and a text block per command, top level first."""
    parts = []
    for path, text in usage():
        depth = min(len(path) + 1, 4)  # scaletrain: ##, scaletrain train: ###, deeper: ####
        parts.append(f"{'#' * depth} `{' '.join(path)}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "cli.md":
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"docs/cli.md lost its {MARKER} line: the reference would be empty")
    return markdown.replace(MARKER, render())
