"""`scaletrain` subcommands; each one a thin call into the library."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scaletrain.errors import ScaletrainError

if TYPE_CHECKING:
    from scaletrain.train import TrainConfig

__all__ = ["build_parser", "main"]


def _add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        help="train a recipe (default: the seeds' ConvNet on Fashion-MNIST) with DDP",
        description=(
            "Train a recipe on this machine: one process per GPU, or 2 on CPU. Under "
            "torchrun, srun or mpirun each process joins the job it was started in."
        ),
    )
    p.add_argument(
        "--recipe",
        default=None,
        help="convnet | split-net | wrn | gpt (default: convnet; gpt with tensor parallel)",
    )
    p.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, else 2)")
    p.add_argument(
        "--epochs", type=int, default=None, help="passes over the data (default: recipe's)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per replica per step (default: recipe's)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: recipe)")
    p.add_argument(
        "--strategy",
        default="ddp",
        help="ddp | fsdp | tensor | pipeline | dp | model-parallel | single (default: ddp)",
    )
    p.add_argument("--mesh", default=None, help="device mesh, e.g. dp=2,tp=2 or dp=2,pp=2")
    p.add_argument(
        "--sync-bn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SyncBatchNorm across data-parallel ranks (default: the recipe's)",
    )
    p.add_argument("--backend", default=None, help="nccl | gloo (default: by device)")
    p.add_argument("--data-dir", default=None, help="dataset directory (default: search)")
    p.add_argument("--out", default=None, help="run directory (default: runs/<recipe>-<time>)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--log-every", type=int, default=20, help="steps between metric records")
    p.add_argument(
        "--precision",
        default="32",
        help="32 | bf16-mixed | fp16-mixed (CUDA) | bf16-true (default: 32)",
    )
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip-grad", type=float, default=None, help="clip to this whole-model norm")
    p.add_argument(
        "--save-every", type=int, default=None, help="checkpoint every N steps into OUT/checkpoints"
    )
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default: 3)")
    p.add_argument(
        "--async-save", action="store_true", help="write sharded checkpoints in the background"
    )
    p.add_argument(
        "--stop-after", type=int, default=None, help="save and stop after N steps of this run"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers after a failure; they resume from the last checkpoint",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=300.0,
        help="seconds a rank may make no progress before the job fails with a diagnosis "
        "(default: 300; 0: off)",
    )


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


def _cmd_checkpoint(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from scaletrain.checkpoint import consolidate, latest_checkpoint
    from scaletrain.errors import CheckpointError

    if ns.action == "latest":
        found = latest_checkpoint(ns.dir)
        if found is None:
            raise CheckpointError(
                f"{ns.dir} holds no complete, valid checkpoint (looked in {ns.dir}/checkpoints). "
                "A run saves them with --save-every N or when it stops."
            )
        print(found)
        return 0
    source = Path(ns.dir)
    if (source / "checkpoints").is_dir():
        newest = latest_checkpoint(source)
        if newest is None:
            raise CheckpointError(f"{source} holds no complete, valid checkpoint to consolidate.")
        source = newest
    written = consolidate(source, ns.out)
    print(f"wrote {written} from {source}")
    return 0


def _add_env(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser(
        "env",
        help="show the detected cluster environment, backend, devices and versions",
        description="Print what scaletrain detects here and why, as a worker would see it.",
    )


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from scaletrain.launch.cli import add_arguments

    p = sub.add_parser(
        "launch",
        help="start a script on N processes per node with torch.distributed.run",
        description=(
            "Start SCRIPT on every process of this node through PyTorch's elastic launcher "
            "(torch.distributed.run), with scaletrain's defaults and checks."
        ),
    )
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scaletrain",
        description="Scale PyTorch training from one device to many GPUs and machines.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_launch(sub)
    _add_checkpoint(sub)
    _add_env(sub)
    return parser


def _cmd_env() -> int:
    import torch
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    import scaletrain
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
    table.add_row("scaletrain", scaletrain.__version__)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    table.add_row(
        "backends available",
        f"gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()} (NCCL {nccl}) "
        f"mpi={dist.is_mpi_available()}",
    )
    console.print(table)
    return 0


def _cmd_train(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from scaletrain.env import detect
    from scaletrain.train import TrainConfig

    config = TrainConfig(
        recipe=ns.recipe,
        nproc=ns.nproc,
        epochs=ns.epochs,
        max_steps=ns.max_steps,
        batch_size=ns.batch_size,
        lr=ns.lr,
        strategy=ns.strategy,
        mesh=ns.mesh,
        sync_bn=ns.sync_bn,
        backend=ns.backend,
        data_dir=ns.data_dir,
        out=ns.out,
        seed=ns.seed,
        log_every=ns.log_every,
        precision=ns.precision,
        accumulate=ns.accumulate,
        clip_grad=ns.clip_grad,
        save_every=ns.save_every,
        keep=ns.keep,
        async_save=ns.async_save,
        stop_after=ns.stop_after,
        max_restarts=ns.max_restarts,
        hang_timeout=ns.hang_timeout,
    )
    _preflight(config)
    env = detect()
    if env.kind != "local" and not env.per_node:
        # Already one rank of a launched job (torchrun, srun, mpirun): train here.
        return _train_here(config)
    if config.out is None:
        # Resolved once, here, so every worker writes to the same directory.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.out = os.path.join("runs", f"{config.resolved_recipe()}-{stamp}")
    nproc = config.nproc
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() or 2
    if config.mesh is not None and not env.per_node:
        from scaletrain.runtime import parse_mesh

        # One error before any process starts, instead of one per rank.
        parse_mesh(config.mesh, nproc)
    if nproc == 1 and not env.per_node and config.max_restarts == 0:
        return _train_here(config)
    from scaletrain.launch import LaunchConfig, launch
    from scaletrain.train.trainer import EXIT_PREEMPTED, PREEMPTED_MARKER

    marker = os.path.join(config.out, PREEMPTED_MARKER)
    if os.path.exists(marker):
        os.unlink(marker)
    worker_args = [*_strip_out(argv), "--out", config.out]
    code = launch(
        LaunchConfig(nproc_per_node=nproc, run_as_module=True, max_restarts=config.max_restarts),
        "scaletrain",
        ["train", *worker_args],
    )
    # A signal to the launcher reaches the workers too: they saved and stopped.
    return EXIT_PREEMPTED if code != 0 and os.path.exists(marker) else code


def _train_here(config: TrainConfig) -> int:
    from scaletrain.train import Trainer
    from scaletrain.train.trainer import EXIT_PREEMPTED, Preempted

    try:
        Trainer(config).run()
    except Preempted:
        return EXIT_PREEMPTED
    return 0


def _preflight(config: TrainConfig) -> None:
    """Check what can be checked before any process starts: one error, not one per rank."""
    from scaletrain.strategies import resolve_strategy
    from scaletrain.train import get_recipe

    recipe = get_recipe(config.resolved_recipe())
    resolve_strategy(config.strategy)
    recipe.check_data(config.data_dir)


def _strip_out(argv: Sequence[str]) -> list[str]:
    """The user's train flags minus --out (replaced by the resolved run directory)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        if arg.startswith("--out="):
            continue
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.version:
        import scaletrain

        print(scaletrain.__version__)
        return 0
    try:
        if ns.command == "env":
            return _cmd_env()
        if ns.command == "train":
            return _cmd_train(ns, args[args.index("train") + 1 :])
        if ns.command == "checkpoint":
            return _cmd_checkpoint(ns)
        if ns.command == "launch":
            from scaletrain.launch.cli import run

            return run(ns)
    except ScaletrainError as exc:
        print(f"scaletrain: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
