"""`scaletrain` subcommands; each one a thin call into the library.

Building the parser imports no torch (the train flags come from TrainConfig, a plain
dataclass), so `scaletrain --help` and `--version` answer at once; a command imports
what it needs when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from scaletrain import __version__
from scaletrain.errors import ConfigError, ScaletrainError, spell, use_cli_names
from scaletrain.exitcodes import EXIT_ABORTED, EXIT_ERROR, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from scaletrain.settings import Parser, command_parser

if TYPE_CHECKING:
    from scaletrain.train import TrainConfig

__all__ = ["build_parser", "main", "train_config"]

_SUPERVISED = "SCALETRAIN_SUPERVISED"
"""Set by `scaletrain train` for the workers it launches: they record errors in their
error files and leave the printing to it (once, for the first rank that failed)."""
_EXIT_BROKEN_PIPE = 128 + 13
"""A shell's code for a command ended by SIGPIPE, which is what a broken pipe is."""


_TRAIN_ELSEWHERE = {
    "--log-dir": "--out DIR: a run keeps its logs (metrics.jsonl, observe/) in its run "
    "directory; --log-dir is `scaletrain launch`'s, for a script's worker output",
    "--nproc-per-node": "--nproc N (processes on this node)",
    "--standalone": "leave it out: one node is the default (several machines: --nnodes N "
    "and --rdzv-endpoint HOST:PORT on each)",
    "--master-addr": "--rdzv-endpoint HOST:PORT replaces --master-addr and --master-port "
    "(with --nnodes, on every node); on one node leave them out: a free port is chosen",
}
_TRAIN_ELSEWHERE["--master-port"] = _TRAIN_ELSEWHERE["--master-addr"]
"""torchrun's and `scaletrain launch`'s flags a train user brings along, and what to pass."""


def _add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from scaletrain.settings import add_flags
    from scaletrain.train.config import FLAG_GROUPS, METAVARS, SWITCHES, TrainConfig

    p = sub.add_parser(
        "train",
        help="train a recipe, or your own model (--model), with any strategy",
        description=(
            "Train a recipe (default: the ConvNet on Fashion-MNIST), your own model module "
            "(--model MODULE:NAME) or a Hugging Face config.json (--model config.json) on "
            "this machine: one process per GPU, or 2 on CPU. Under "
            "torchrun, srun or mpirun each process joins the job it was started in. "
            "Settings come from the flags below, or a --config file holding the same names "
            "(flags win)."
        ),
    )
    p.add_argument(
        "--config", metavar="FILE", default=None,
        help="YAML or JSON file of settings (e.g. a run's config.json); flags given too win",
    )  # fmt: skip
    add_flags(p, TrainConfig, metavars=METAVARS, groups=FLAG_GROUPS, switches=SWITCHES)
    if isinstance(p, Parser):
        p.elsewhere = {**p.elsewhere, **_TRAIN_ELSEWHERE}


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
    p.add_argument("--output", metavar="FILE", default=None, help="write here instead")


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
    "train": _add_train,
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


# -- train ------------------------------------------------------------------------------


def train_config(ns: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed `train` flags (and their --config file) describe."""
    from scaletrain.settings import build_config, typed_flags
    from scaletrain.train.config import TrainConfig

    return build_config(TrainConfig, ns.config, typed_flags(ns, TrainConfig))


def _preflight(config: TrainConfig, nodes: int, hint: int | None) -> tuple[int, int]:
    """Check what can be checked before any process starts; return the processes per
    node and the data-parallel size.

    One error here, in the parent, replaces one traceback per rank after the launch:
    the settings against the hardware (backend, precision), the mesh against the
    process count, the data, and the recipe's model against the strategy (built on
    the meta device: no memory, no devices, no process group).
    """
    import torch

    from scaletrain.dist import Topology, choose_backend, choose_device
    from scaletrain.dist.topology import parse_mesh
    from scaletrain.precision import Precision
    from scaletrain.strategies import resolve_strategy
    from scaletrain.train.config import SINGLE_PROCESS_STRATEGIES
    from scaletrain.train.model_module import check_recipe
    from scaletrain.train.recipes import recipe_for

    recipe = recipe_for(config)
    check_recipe(recipe)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = hint if config.nproc is None and hint else config.default_nproc(gpus)
    world = nproc * nodes
    if config.strategy in SINGLE_PROCESS_STRATEGIES and world > 1:
        raise ConfigError(
            f"{spell('strategy', config.strategy)} runs in ONE process, but this job has "
            f"{world} ({nodes} nodes x {nproc}). Fix: {spell('nproc', 1)} on one node, or "
            f"{spell('strategy', 'ddp')}.",
            field="strategy",
        )
    backend = choose_backend(config.backend)
    device = choose_device(0, backend=backend)
    Precision(name=config.precision, device=device)
    mesh = parse_mesh(config.mesh, world) if config.mesh is not None else None
    strategy = resolve_strategy(config.strategy_object(), mesh=mesh)
    topo = Topology(
        world_size=world,
        local_world_size=nproc,
        device=device,
        backend=backend,
        mesh_shape=dict(mesh) if mesh else {strategy.mesh_dim: world},
        mesh_given=bool(mesh),
    )
    strategy.validate(topo)
    with torch.device("meta"):
        model = recipe.build()
    strategy.check_model(model, topo)
    recipe.locate_data(config.data_dir)
    if device.type == "cpu":
        _warn_oversubscribed(config, recipe, nproc, topo.dp_size)
    return nproc, topo.dp_size


_CORES_PER_PROCESS = 0.5
"""Fewer CPU cores than this per training process is warned about: each step waits for
the slowest rank, and a rank without a core of its own waits for one."""


def _warn_oversubscribed(config: TrainConfig, recipe: Any, nproc: int, dp_size: int) -> None:
    """One line when --nproc asks for far more CPU processes than this machine has cores
    (they train, slowly) and, unless --lr is given, the learning rate that the linear
    scaling rule gives their global batch: both are easy to miss and cost a whole run."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if nproc * _CORES_PER_PROCESS <= cores:
        return
    line = (
        f"scaletrain: warning: {spell('nproc', nproc)} starts {nproc} training processes on "
        f"{cores} CPU core{'s' if cores != 1 else ''} ({nproc / cores:.3g} per core; every "
        "step waits for the slowest, so it runs far slower than with fewer)"
    )
    fix = f"{spell('nproc', cores)}"
    if config.lr is None and recipe.reference_batch is not None:
        global_batch = (config.batch_size or recipe.batch_size) * dp_size * config.accumulate
        line += (
            f", and the learning rate scales with the global batch of {global_batch:,} to "
            f"{recipe.scaled_lr(global_batch):g} (the recipe's {recipe.lr:g} at "
            f"{recipe.reference_batch:,})"
        )
        fix += f", or set {spell('lr')}"
    print(f"{line}. Fix: {fix}.", file=sys.stderr, flush=True)


# Flags with a value that the launcher consumes; the workers it starts are ranks of the
# job it formed, so they get neither these nor an --env that would make them launchers.
_LAUNCHER_FLAGS = (
    "--out", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--local-addr", "--env",
)  # fmt: skip


def _worker_args(argv: Sequence[str], out: str | None) -> list[str]:
    """The user's train flags minus --out (replaced by the resolved run directory; None:
    rank 0 chooses it) and the topology flags, which are this launcher's, not theirs."""
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _LAUNCHER_FLAGS:
            skip = True
            continue
        if arg.split("=", 1)[0] in _LAUNCHER_FLAGS:
            continue
        args.append(arg)
    return [*args, "--out", out] if out is not None else args


def _cmd_train(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    # scaletrain.sigint, not scaletrain.runtime.signals: importing the runtime package
    # imports torch, and a Ctrl-C during that import, unheld, could be lost.
    from scaletrain.sigint import ctrl_c_held

    with ctrl_c_held():
        import torch  # noqa: F401
    from scaletrain.launch.training import default_out, place

    config = train_config(ns)
    placement = place(config)
    out = default_out(config, placement, os.environ)
    if placement.mode == "rank":
        # Already one rank of a launched job (torchrun, srun, mpirun): train here.
        return _train_here(config.replace(out=out), worker=True)
    nproc, dp_size = _preflight(config, placement.nodes, placement.procs_per_node_hint)
    from scaletrain.train.recipes import recipe_for
    from scaletrain.train.resume import check_start
    from scaletrain.train.rundir import inspect_run, refuse_reuse

    # A finished run is not trained over by accident, and a resume or a fork the run
    # directory refuses is refused: said here, before any launch and before anything is
    # written (where rank 0 names the run, None here, the workers say it).
    run_dir = config.fork or out
    if run_dir is not None:
        field = "fork" if config.fork else "out"
        refuse_reuse(inspect_run(run_dir), overwrite=config.overwrite, field=field)
    if not config.overwrite or config.fork:
        check_start(
            config.replace(out=out),
            recipe=recipe_for(config),
            dp_size=dp_size,
        )
    if placement.mode == "srun":
        from scaletrain.launch import LaunchConfig, launch

        # A batch script: the same command on every node of the allocation (this never
        # returns); the checks above ran once, here, before any node started.
        return launch(
            LaunchConfig(),
            "scaletrain",
            relaunch=[sys.executable, "-m", "scaletrain", "train", *argv],
        )
    single = nproc == 1 and placement.nodes == 1 and config.max_restarts == 0
    if single and (placement.env is None or not placement.env.per_node):
        return _train_here(config.replace(out=out), worker=False)
    from scaletrain.launch import LaunchConfig, launch
    from scaletrain.launch.guard import SIGINT_HELD
    from scaletrain.launch.launcher import LaunchReport
    from scaletrain.train.rundir import PREEMPTED_MARKER, remove_pid_files

    marker = os.path.join(run_dir, PREEMPTED_MARKER) if run_dir is not None else None
    if marker is not None and os.path.exists(marker):
        os.unlink(marker)
    report = LaunchReport()
    code = launch(
        LaunchConfig(
            nproc_per_node=nproc,
            nnodes=config.nnodes,
            node_rank=config.node_rank,
            rdzv_endpoint=config.rdzv_endpoint,
            rdzv_id=config.rdzv_id,
            local_addr=config.local_addr,
            cluster=config.env,
            run_as_module=True,
            # 0 (the default) lets a platform's own setting apply (a Kubeflow elasticPolicy).
            max_restarts=config.max_restarts or None,
            monitor_interval=config.monitor_interval,
            extra_env={_SUPERVISED: "1", SIGINT_HELD: "1"},
        ),
        "scaletrain",
        ["train", *_worker_args(argv, out)],
        env=placement.env,
        quiet=True,
        report=report,
    )
    if run_dir is not None:
        # Workers killed at once (a second Ctrl-C, the OOM killer) could not remove theirs.
        remove_pid_files(run_dir, report.workers)
    if report.interrupts > 1:
        return EXIT_ABORTED  # a second Ctrl-C, also after the save: the user said "now"
    # A signal to the launcher reaches the workers too: they saved and stopped.
    if code != 0 and marker is not None and os.path.exists(marker):
        return EXIT_PREEMPTED
    if report.interrupts and code == EXIT_ABORTED:
        # Ctrl-C before the workers could save anything: they stay quiet, this says it.
        print("\nscaletrain: interrupted.", file=sys.stderr)
    return code


def _train_here(config: TrainConfig, *, worker: bool) -> int:
    """Train in this process; as a worker of a launched job, report a failure once."""
    from scaletrain.train import Trainer
    from scaletrain.train.trainer import Preempted

    trainer = Trainer(config, worker=worker)
    try:
        trainer.run()
    except Preempted:
        return EXIT_PREEMPTED
    except Exception as exc:
        if not worker:
            raise
        return _report_worker_failure(exc, trainer)
    return EXIT_OK


def _report_worker_failure(exc: Exception, trainer: Any) -> int:
    """A worker's failure: recorded for our launcher, or printed by the first rank only."""
    from scaletrain.launch import record_failure

    usage = isinstance(exc, ScaletrainError)
    code = EXIT_USAGE if usage else EXIT_ERROR
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(_SUPERVISED) and record_failure(exc, rank=rank, usage=usage, exit_code=code):
        return code  # `scaletrain train` prints it, once
    if getattr(trainer, "first_failure", True):
        if usage:
            print(f"scaletrain: error on rank {rank}: {exc}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__)
    return code


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

    console = Console()
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
        if os.environ.get(_SUPERVISED):
            from scaletrain.launch.guard import release_sigint

            # Started with Ctrl-C held (launch/guard.py): one pressed while this worker
            # started raises KeyboardInterrupt here, below, not inside an import.
            release_sigint()
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before any worker started (or in a one-process command): no traceback.
        # A worker of `scaletrain train` stays quiet: its launcher says it, once.
        if not os.environ.get(_SUPERVISED):
            print("\nscaletrain: interrupted.", file=sys.stderr)
        return EXIT_ABORTED
    except BrokenPipeError:
        # The reader of stdout went away (`scaletrain plan ... | head`): stop quietly, as
        # `ls | head` does. Only stdout's: another pipe or socket (the user's code's) is
        # an error to show. Python would flush stdout again at exit and print a second
        # error: stdout is pointed at /dev/null first.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return _EXIT_BROKEN_PIPE
        raise


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
            return _cmd_train(ns, args[args.index("train") + 1 :])
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
