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
from scaletrain.launch.config import DEFAULT_RDZV_TIMEOUT_S, LaunchConfig
from scaletrain.launch.launcher import dry_run_command, launch

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "config_from_args", "relaunch_command", "run"]

HELP = "start SCRIPT on every process of this node with torchrun (one call per node)"
DESCRIPTION = (
    "Start SCRIPT on --nproc-per-node worker processes of this node through PyTorch's "
    "elastic launcher (torch.distributed.run), with RANK, LOCAL_RANK, WORLD_SIZE, "
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `launch` flags and the SCRIPT [ARGS...] positionals to `parser`."""
    from scaletrain.settings import Parser

    if isinstance(parser, Parser):
        parser.elsewhere = _ELSEWHERE
    # argparse sorts every word into option or positional before SCRIPT's REMAINDER
    # takes its share, and errors on a script flag that abbreviates two of ours
    # (`--nproc`). With abbreviations off, such words are left for the script.
    parser.allow_abbrev = False
    g = parser.add_argument_group("processes and nodes")
    g.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        metavar="N",
        help="worker processes on this node (default: one per GPU, 2 on CPU)",
    )
    g.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help='number of nodes, or an elastic range such as "1:4" (default: 1)',
    )
    g.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's index; node 0 hosts the rendezvous store at --rdzv-endpoint",
    )
    r = parser.add_argument_group("rendezvous")
    r.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet: node 0's address and a free port (multi-node only)",
    )
    r.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default=None,
        metavar="ID",
        help="job id, the same on every node (default: $SCALETRAIN_RDZV_ID, $SLURM_JOB_ID "
        "or 'scaletrain')",
    )
    r.add_argument(
        "--local-addr",
        "--local_addr",
        default=None,
        metavar="ADDR",
        help="this node's address as the other nodes reach it (default: the address of the "
        "interface that routes to them)",
    )
    r.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        type=int,
        default=DEFAULT_RDZV_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for the store and the other nodes (default: {DEFAULT_RDZV_TIMEOUT_S})",
    )
    w = parser.add_argument_group("workers")
    w.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=None,
        metavar="K",
        help="restart the worker group up to K times after a failure (default: the "
        "platform's, e.g. a Kubeflow elasticPolicy's, else 0)",
    )
    w.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.1,
        metavar="S",
        help="seconds between worker health checks (default: 0.1)",
    )
    w.add_argument(
        "--log-dir",
        "--log_dir",
        default=None,
        metavar="DIR",
        help="directory for worker logs and error files (default: a temporary directory)",
    )
    w.add_argument(
        "--redirects",
        default="0",
        metavar="0-3",
        help="write worker output to files in --log-dir: 1 stdout, 2 stderr, 3 both (default: 0)",
    )
    w.add_argument(
        "--env",
        dest="extra_env",
        action=_EnvAction,
        default=[],
        metavar="NAME=VALUE|KIND",
        help="NAME=VALUE: set a variable for the workers (repeatable); KIND: the cluster "
        "environment to read instead of detecting it (local, slurm, mpi, sagemaker, "
        "kubeflow, torchelastic); --env local runs here as one node, even in a batch script",
    )
    w.add_argument(
        "-m",
        "--module",
        dest="run_as_module",
        action="store_true",
        help="run SCRIPT as a module, like python -m",
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
    return LaunchConfig(
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        max_restarts=ns.max_restarts,
        rdzv_timeout=ns.rdzv_timeout,
        monitor_interval=ns.monitor_interval,
        run_as_module=ns.run_as_module,
        log_dir=ns.log_dir,
        redirects=ns.redirects,
        extra_env=dict(ns.extra_env),
        local_addr=ns.local_addr,
        cluster=getattr(ns, "cluster", None),
    )


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
