"""The `scaletrain launch` subcommand: flags -> LaunchConfig -> launch().

The top-level CLI wires it as::

    p = sub.add_parser("launch", help=HELP, description=DESCRIPTION)
    add_arguments(p)
    ...
    return run(ns)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.exitcodes import EXIT_OK, EXIT_USAGE
from scaletrain.launch.config import LaunchConfig
from scaletrain.launch.launcher import dry_run_command, launch

__all__ = [
    "DESCRIPTION",
    "FLAG_GROUPS",
    "HELP",
    "METAVARS",
    "add_arguments",
    "config_from_args",
    "relaunch_command",
    "run",
]

HELP = "start SCRIPT on every process of this node with torchrun (one call per node)"
DESCRIPTION = (
    "Start SCRIPT on --nproc-per-node worker processes of this node through PyTorch's "
    "elastic launcher (torch.distributed.launcher, what torchrun runs), with RANK, LOCAL_RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT set for each. On one node no rendezvous flags are "
    "needed. On several nodes, run the same command on each with the same "
    "--nnodes/--rdzv-endpoint/--rdzv-id and --node-rank 0 on the node at the endpoint. "
    "Under SageMaker, Kubeflow, or srun/mpirun with one task per node, the node count, "
    "rank and address come from the job; in a Slurm batch script the command runs again "
    "under srun, one launcher per node of the allocation. Everything after SCRIPT is "
    "passed to it."
)


class _EnvAction(argparse.Action):
    """--env NAME=VALUE sets a variable for the workers; --env KIND picks the cluster
    environment to read (`--env local`: this node alone, even in a batch script)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        value: Any,
        option: Any = None,
    ) -> None:
        text = str(value)
        key, sep, val = text.partition("=")
        if sep:
            if not key:
                raise argparse.ArgumentError(self, f"expected NAME=VALUE, got {text!r}")
            ns.extra_env = [*(ns.extra_env or []), (key, val)]
        else:
            ns.cluster = text.strip().lower()


_ELSEWHERE = {
    "--standalone": "leave it out: one node is the default; for several machines, run the "
    "same command on each with --nnodes N and --rdzv-endpoint HOST:PORT",
    "--master-addr": "--rdzv-endpoint HOST:PORT replaces --master-addr and --master-port "
    "(node 0's address and a free port, with --nnodes and --node-rank); on one node leave "
    "them out: a free port is chosen",
}
_ELSEWHERE["--master-port"] = _ELSEWHERE["--master-addr"]
"""torchrun's flags that scaletrain launch says otherwise (see Parser.elsewhere)."""


FLAG_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("processes and nodes", ("nproc_per_node", "nnodes", "node_rank")),
    ("rendezvous", ("rdzv_endpoint", "rdzv_id", "local_addr", "rdzv_timeout")),
    ("workers", ("max_restarts", "monitor_interval", "log_dir", "redirects", "run_as_module")),
)
"""The sections of --help, each with its LaunchConfig fields in order."""

METAVARS = {
    "nproc_per_node": "N", "nnodes": "N|MIN:MAX", "node_rank": "R", "rdzv_endpoint": "HOST:PORT",
    "rdzv_id": "ID", "local_addr": "ADDR", "rdzv_timeout": "S", "max_restarts": "K",
    "monitor_interval": "S", "log_dir": "DIR", "redirects": "0-3",
}  # fmt: skip
"""The placeholder each flag shows in --help."""

_BY_HAND = ("extra_env", "cluster")
"""Fields that share one flag, --env NAME=VALUE|KIND (_EnvAction), added by hand."""


def _option_strings(name: str) -> tuple[str, ...]:
    """A field's flag and torchrun's spelling of it (`--nproc_per_node`); `-m` for the module."""
    if name == "run_as_module":
        return ("-m", "--module")
    flag = "--" + name.replace("_", "-")
    return (flag, "--" + name) if "_" in name else (flag,)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `launch` flags (one per LaunchConfig field) and the SCRIPT [ARGS...]
    positionals to `parser`."""
    from scaletrain.settings import Parser, add_flags, field_specs

    if isinstance(parser, Parser):
        parser.elsewhere = _ELSEWHERE
    # argparse sorts every word into option or positional before SCRIPT's REMAINDER
    # takes its share, and errors on a script flag that abbreviates two of ours
    # (`--nproc`). With abbreviations off, such words are left for the script.
    parser.allow_abbrev = False
    sections = add_flags(
        parser,
        LaunchConfig,
        metavars=METAVARS,
        exclude=_BY_HAND,
        groups=FLAG_GROUPS,
        switches=("run_as_module",),
        names={spec.name: _option_strings(spec.name) for spec in field_specs(LaunchConfig)},
    )
    sections["workers"].add_argument(
        "--env",
        dest="extra_env",
        action=_EnvAction,
        default=[],
        metavar="NAME=VALUE|KIND",
        help="NAME=VALUE: set a variable for the workers (repeatable); KIND: the cluster "
        "environment to read instead of detecting it (local, slurm, mpi, sagemaker, "
        "kubeflow, torchelastic); --env local runs here as one node, even in a batch script",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the equivalent command (the variables it sets, then torchrun) and exit",
    )
    parser.add_argument("script", metavar="SCRIPT", help="training script path (or module with -m)")
    # REMAINDER, as torchrun does, so flags after SCRIPT go to the script, not to us.
    args = parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments passed to SCRIPT (optional)",
    )
    # argparse marks every REMAINDER positional required, so a missing SCRIPT was
    # reported as "required: SCRIPT, ARGS"; the script's arguments are optional.
    args.required = False


def config_from_args(ns: argparse.Namespace) -> LaunchConfig:
    """Build the LaunchConfig the parsed flags describe (raises ConfigError)."""
    from scaletrain.settings import typed_flags

    flags = typed_flags(ns, LaunchConfig)
    flags["extra_env"] = dict(flags.get("extra_env") or ())
    return LaunchConfig(**flags)


def relaunch_command(argv: Sequence[str], prog: Sequence[str]) -> list[str]:
    """The command that started this launcher, for srun to run on every node (without
    --dry-run, which only the batch script's own call should obey)."""
    return [*prog, *(a for a in argv if a != "--dry-run")]


def run(
    ns: argparse.Namespace,
    argv: Sequence[str] | None = None,
    prog: Sequence[str] = (sys.executable, "-m", "scaletrain", "launch"),
) -> int:
    """Run the subcommand; return the process exit code: 2 for input it cannot use (a
    flag, a missing script, a taken port, an endpoint that does not answer), else the
    workers' code. `argv` (the subcommand's words) and `prog` let a Slurm batch script
    run the same command under srun."""
    script_args = list(ns.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]  # `launch SCRIPT -- ARGS` is accepted too
    relaunch = None if argv is None else relaunch_command(argv, prog)
    try:
        cfg = config_from_args(ns)
        if ns.dry_run:
            print(dry_run_command(cfg, ns.script, script_args, relaunch=relaunch))
            return EXIT_OK
        return launch(cfg, ns.script, script_args, relaunch=relaunch)
    except ScaletrainError as exc:
        print(f"scaletrain launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
