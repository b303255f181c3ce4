"""`scaletrain` subcommands; each one a thin call into the library.

Building the parser imports no torch (the train flags come from TrainConfig, a plain
dataclass), so `scaletrain --help` and `--version` answer at once; a command imports
what it needs when it runs. `scaletrain train`, the flags, checks and launch behind
it, is scaletrain.train_command's.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from scaletrain import __version__
from scaletrain.errors import ScaletrainError, use_cli_names
from scaletrain.exitcodes import EXIT_ABORTED, EXIT_OK, EXIT_USAGE
from scaletrain.settings import Parser, command_parser
from scaletrain.train_command import SUPERVISED, add_train_parser, run_train, train_config

__all__ = ["build_parser", "main", "train_config"]

_EXIT_BROKEN_PIPE = 128 + 13
"""A shell's code for a command ended by SIGPIPE, which is what a broken pipe is."""


def _add_checkpoint(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect and convert checkpoints",
        description="Inspect and convert scaletrain checkpoints (no process group needed).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser(
        "consolidate",
        help="write one plain state dict from a full or sharded checkpoint",
        description=(
            "Write ONE plain model state dict (no wrapper prefixes) that loads into the bare "
            "model with torch.load(OUT, weights_only=True)."
        ),
    )
    c.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run directory")
    c.add_argument("out", metavar="OUT.pt", help="file to write")
    latest = actions.add_parser("latest", help="print the newest valid checkpoint of a run")
    latest.add_argument("dir", metavar="RUN", help="a run directory (--out of scaletrain train)")
    export = actions.add_parser(
        "export",
        help="write a run's Hugging Face model as a from_pretrained directory",
        description=(
            "Write the model of a run trained with --model (a transformers model) as a "
            "Hugging Face directory, config.json and model.safetensors, from its model.pt "
            "or its newest valid checkpoint, whatever strategy trained it: "
            "from_pretrained(DIR) loads it."
        ),
    )
    export.add_argument("dir", metavar="RUN", help="a run directory (--out of scaletrain train)")
    export.add_argument("out", metavar="DIR", help="a new (or empty) directory to write")


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="write RUN/report.html: where the time went, per rank (opens offline)",
        description=(
            "Write RUN/report.html from the step ledger's files (RUN/observe/): the per-rank "
            "step breakdown, step time per rank, overlap, throughput, loss and lr, MFU, memory."
        ),
    )
    p.add_argument("run", metavar="RUN", help="a run directory (--out of scaletrain train)")
    p.add_argument(
        "--output", metavar="FILE", default=None,
        help="write here instead (a directory: report.html in it); a file that is not a "
        "report is never replaced",
    )  # fmt: skip


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from scaletrain.planner.command import add_plan_parser

    add_plan_parser(sub)


def _add_env(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser(
        "env",
        help="show the detected cluster environment, backend, devices and versions",
        description="Print what scaletrain detects here and why, as a worker would see it.",
    )


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from scaletrain.launch.cli import DESCRIPTION, HELP, add_arguments

    p = sub.add_parser("launch", help=HELP, description=DESCRIPTION)
    add_arguments(p)


def _add_job(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from scaletrain.launch.jobs.cli import add_job_parsers

    add_job_parsers(sub)


_COMMANDS = {
    "train": add_train_parser,
    "launch": _add_launch,
    "job": _add_job,
    "checkpoint": _add_checkpoint,
    "report": _add_report,
    "plan": _add_plan,
    "env": _add_env,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or only `command`'s part: every worker parses its train flags
    again, and the launch and job parsers' imports cost 0.05-0.1 s of its start."""
    parser = Parser(
        prog="scaletrain",
        description="Scale PyTorch training from one device to many GPUs and machines.",
    )
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    # Each command's parser a Parser too (one-line refusals); typed as argparse's.
    sub: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=Parser
    )
    for name, add in _COMMANDS.items():
        if command is None or name == command:
            add(sub)
    return parser


# -- checkpoint, env ----------------------------------------------------------------------


def _cmd_checkpoint(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from scaletrain.checkpoint import MANIFEST, consolidate
    from scaletrain.checkpoint.catalog import explain_no_checkpoint, newest_valid
    from scaletrain.errors import CheckpointError

    source = Path(ns.dir)
    if ns.action == "export":
        from scaletrain.train.export import export_hf

        written, weights = export_hf(source, ns.out)
        print(f"wrote {written} (config.json, model.safetensors) from {weights}")
        return EXIT_OK
    if ns.action == "consolidate" and (source / MANIFEST).is_file():
        # A checkpoint directory itself: consolidate() says what is wrong with it.
        written = consolidate(source, ns.out)
        print(f"wrote {written} from {source}")
        return EXIT_OK
    found, skipped = newest_valid(source)
    if found is None:
        raise CheckpointError(f"no complete, valid checkpoint: {explain_no_checkpoint(source)}")
    for path, why in skipped:
        # A newer checkpoint passed over is said, never skipped silently (stderr: stdout
        # stays the one path a script reads).
        print(f"scaletrain: skipped {path.name}, newer than {found.name}: {why}", file=sys.stderr)
    if ns.action == "latest":
        print(found)
        return EXIT_OK
    written = consolidate(found, ns.out)
    print(f"wrote {written} from {found}")
    return EXIT_OK


def _cmd_env() -> int:
    import platform

    import torch
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    from scaletrain.dist import choose_backend
    from scaletrain.env import detect
    from scaletrain.env.report import describe

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own exits with code 1; main() ends a closed stdout's command with 141.
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    console = _Console()
    env = detect()
    table = Table(title="scaletrain env", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in describe(env):
        table.add_row(key, value)
    backend = choose_backend(None)
    why = "CUDA available" if torch.cuda.is_available() else "no CUDA device: CPUs"
    table.add_row("backend", f"{backend} ({why})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            table.add_row(f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        table.add_row("devices", f"cpu ({os.cpu_count()} cores)")
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    table.add_row("scaletrain", __version__)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    table.add_row(
        "backends available",
        f"gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()} (NCCL {nccl}) "
        f"mpi={dist.is_mpi_available()}",
    )
    console.print(table)
    return EXIT_OK


# -- entry point ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    try:
        if os.environ.get(SUPERVISED):
            from scaletrain.launch.guard import release_sigint

            # Started with Ctrl-C held (launch/guard.py): one pressed while this worker
            # started raises KeyboardInterrupt here, below, not inside an import.
            release_sigint()
        try:
            code = _main(argv)
        except SystemExit:
            # argparse's --help, --version and usage errors. What they printed is written
            # here, where a reader gone away is seen (the BrokenPipeError below), not by
            # Python at exit (which says "Exception ignored ... BrokenPipeError" and exits
            # 120); a write argparse could not make raises (settings.Parser).
            _flush_stdout()
            raise
        _flush_stdout()
        return code
    except KeyboardInterrupt:
        # Ctrl-C before any worker started (or in a one-process command): no traceback.
        # A worker of `scaletrain train` stays quiet: its launcher says it, once.
        if not os.environ.get(SUPERVISED):
            print("\nscaletrain: interrupted.", file=sys.stderr)
        return EXIT_ABORTED
    except BrokenPipeError:
        # The reader of stdout went away (`scaletrain plan ... | head`): stop quietly, as
        # `ls | head` does. Only stdout's: another pipe or socket (the user's code's) is
        # an error to show.
        if _stdout_is_gone():
            return _end_quietly()
        raise


def _end_quietly() -> int:
    """A closed stdout's exit code. Python would flush stdout again at exit and print a
    second error: stdout is pointed at /dev/null first."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return _EXIT_BROKEN_PIPE


def _flush_stdout() -> None:
    """Write what stdout still holds; a broken pipe raises (a stdout that is None or
    closed, nothing to write to, is left alone)."""
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()


def _stdout_is_gone() -> bool:
    """Whether stdout's reader went away: what it still holds cannot be written, or,
    where the failed write left nothing to hold (an unbuffered stdout, a line longer
    than the buffer), its pipe or socket says no one reads it (poll: POLLERR, POLLHUP)."""
    try:
        _flush_stdout()
    except BrokenPipeError:
        return True
    except OSError:
        return False
    try:
        import select

        poller = select.poll()  # not on Windows: AttributeError
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # a StringIO, a closed stdout
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


@contextlib.contextmanager
def _warnings_in_our_voice() -> Iterator[None]:
    """scaletrain's own warnings print as one line, `scaletrain: warning: ...`, while a
    command runs: Python's format adds the file and source line of the warn() call, which
    mean nothing to a user of the command. Other warnings keep Python's format."""
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    default = warnings.formatwarning

    def fmt(message: Any, category: Any, filename: str, lineno: int, line: Any = None) -> str:
        if os.path.abspath(filename).startswith(package):
            return f"scaletrain: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = default


def _main(argv: Sequence[str] | None) -> int:
    with _warnings_in_our_voice():
        return _command(argv)


def _command(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    use_cli_names()
    # The first word names the command; anything else (--help, a typo) gets the whole CLI.
    parser = build_parser(args[0] if args and args[0] in _COMMANDS else None)
    ns, extra = parser.parse_known_args(args)
    if extra:
        # A word typed before the command is the whole CLI's, not the command's.
        first = args.index(ns.command) if ns.command in args else len(args)
        before = any(e in args[:first] for e in extra)
        target = parser if before and isinstance(parser, Parser) else command_parser(parser, ns)
        target.unrecognized(extra)
    try:
        if ns.command == "env":
            return _cmd_env()
        if ns.command == "train":
            return run_train(ns, args[args.index("train") + 1 :])
        if ns.command == "checkpoint":
            return _cmd_checkpoint(ns)
        if ns.command == "job":
            from scaletrain.launch.jobs.cli import run_job

            return run_job(ns, train_config)
        if ns.command == "report":
            from scaletrain.observe.report.html import write_report

            print(f"wrote {write_report(ns.run, ns.output)}")
            return EXIT_OK
        if ns.command == "plan":
            from scaletrain.planner.command import run_plan

            return run_plan(ns)
        if ns.command == "launch":
            from scaletrain.launch.cli import run

            return run(ns, args[args.index("launch") + 1 :])
    except ScaletrainError as exc:
        print(f"scaletrain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
