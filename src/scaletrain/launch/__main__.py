"""`python -m scaletrain.launch ...`: the launch subcommand without the top-level CLI."""

from __future__ import annotations

import sys

from scaletrain.launch.cli import DESCRIPTION, add_arguments, run
from scaletrain.settings import Parser

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="python -m scaletrain.launch", description=DESCRIPTION)
    add_arguments(parser)
    ns, extra = parser.parse_known_args(args)
    if extra:
        parser.unrecognized(extra)
    return run(ns, args, prog=(sys.executable, "-m", "scaletrain.launch"))


if __name__ == "__main__":
    sys.exit(main())
