"""`python -m scaletrain.launch ...`: the launch subcommand without the top-level CLI."""

from __future__ import annotations

import argparse
import sys

from scaletrain.launch.cli import DESCRIPTION, add_arguments, run

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m scaletrain.launch", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(args), args, prog=(sys.executable, "-m", "scaletrain.launch"))


if __name__ == "__main__":
    sys.exit(main())
