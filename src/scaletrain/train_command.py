"""`scaletrain train`: its flags, the checks made before any process starts, and the
run, here or in the workers it launches (each of which reports its own failure once).

Its top imports nothing more than the CLI's (`scaletrain --help` builds its parser);
torch, the launcher and the training stack are imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError, ScaletrainError, spell
from scaletrain.exitcodes import EXIT_ABORTED, EXIT_ERROR, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from scaletrain.settings import Parser

if TYPE_CHECKING:
    from scaletrain.train import TrainConfig

__all__ = ["SUPERVISED", "add_train_parser", "run_train", "train_config"]

SUPERVISED = "SCALETRAIN_SUPERVISED"
"""Set by `scaletrain train` for the workers it launches: they record errors in their
error files and leave the printing to it (once, for the first rank that failed)."""


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


def add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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

    from scaletrain._lazy import on_meta
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
    with on_meta():
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


def run_train(ns: argparse.Namespace, argv: Sequence[str]) -> int:
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
            extra_env={SUPERVISED: "1", SIGINT_HELD: "1"},
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
    if os.environ.get(SUPERVISED) and record_failure(exc, rank=rank, usage=usage, exit_code=code):
        return code  # `scaletrain train` prints it, once
    if getattr(trainer, "first_failure", True):
        if usage:
            print(f"scaletrain: error on rank {rank}: {exc}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__)
    return code
