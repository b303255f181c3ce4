"""`scaletrain plan`: its flags and its run (the CLI's words for st.plan, `--check`
and `--calibrate`)."""

from __future__ import annotations

import argparse
import sys

from scaletrain.errors import ConfigError, spell
from scaletrain.exitcodes import EXIT_OK
from scaletrain.hardware import shipped

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="memory per device and step time of every strategy at N devices",
        description=(
            "Predict, for every strategy and mesh of N devices (ddp, fsdp, tensor, pipeline "
            "and their meshes), the peak memory per device and the step time, from the model "
            "and a hardware file; recommend the fastest that fits. --calibrate measures this "
            "machine into such a file; --check RUN compares a finished run with its plan."
        ),
    )
    which = p.add_mutually_exclusive_group()
    # The recipes are named here, not read from their registry: it imports torch, which
    # `--help` need not. The hardware profiles are the package's files (no torch).
    which.add_argument(
        "--recipe", metavar="R", default=None,
        help="a recipe: convnet, gpt, llama, llama-1b, llama-8b, split-net, wrn (default convnet)",
    )  # fmt: skip
    which.add_argument(
        "--model", metavar="MODEL", default=None,
        help="MODULE:FACTORY (the model protocol of scaletrain train), or a Hugging Face "
        "config.json (or its directory): built on the meta device, nothing downloaded",
    )  # fmt: skip
    p.add_argument(
        "--devices", metavar="N", type=int, default=None,
        help="devices in all (required, but for --check and --calibrate)",
    )  # fmt: skip
    p.add_argument(
        "--hardware", metavar="NAME|FILE", default=None,
        help=f"a shipped profile ({', '.join(shipped())}) or a hardware file; default: "
        "this machine's calibration (--calibrate)",
    )  # fmt: skip
    p.add_argument("--batch-size", metavar="B", type=int, default=None, help="per replica")
    p.add_argument(
        "--accumulate", metavar="K", type=int, default=None,
        help="micro-steps of --batch-size per step (gradient accumulation; default 1)",
    )  # fmt: skip
    p.add_argument("--seq-len", metavar="T", type=int, default=None, help="tokens per sample")
    # --precision and --ac default to None, resolved where the plan is made ("32",
    # "none"): `--check`, which takes them from the run, tells a given one apart.
    p.add_argument(
        "--precision", metavar="P", default=None,
        help="32, bf16-mixed, fp16-mixed or bf16-true (default: 32)",
    )  # fmt: skip
    p.add_argument(
        "--ac", choices=("none", "full", "selective"), default=None,
        help="activation checkpointing, as scaletrain train takes it (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--ac-every", metavar="K", type=int, default=None,
        help="with --ac selective: every K-th block checkpointed whole",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="plan the blocks compiled")
    p.add_argument(
        "--float8", action="store_true",
        help="plan the blocks' Linear layers in float8, as scaletrain train --float8 trains them",
    )  # fmt: skip
    p.add_argument("--check", metavar="RUN", default=None, help="a finished run to check")
    p.add_argument(
        "--calibrate", metavar="FILE", nargs="?", const="", default=None,
        help="measure this machine (matmuls, memory, collectives: about a minute) and write "
        "its hardware file (default: scaletrain's cache, which plans without --hardware use)",
    )  # fmt: skip


def run_plan(ns: argparse.Namespace) -> int:
    model_flags = ("recipe", "model", "devices", "batch_size", "accumulate", "seq_len",
                   "precision", "ac", "ac_every", "compile", "float8")  # fmt: skip
    if ns.calibrate is not None:
        if given := [f for f in (*model_flags, "hardware", "check") if _given(ns, f)]:
            raise ConfigError(
                f"{spell('calibrate')} measures this machine and plans nothing, but "
                f"{spell(given[0], getattr(ns, given[0]))} was given too. Fix: calibrate first, "
                "then plan with the file it writes.",
                field="calibrate",
            )
        from scaletrain.hardware.calibrate import calibrate, calibrated_path

        if not ns.calibrate:  # scaletrain's own place for it: made on first use
            calibrated_path().parent.mkdir(parents=True, exist_ok=True)
        path = ns.calibrate or str(calibrated_path())
        hw = calibrate(path)
        print(f"wrote {path}: {hw.description}")
        return EXIT_OK
    if ns.check is not None:
        if given := [f for f in model_flags if _given(ns, f)]:
            raise ConfigError(
                f"{spell('check', ns.check)} takes the model and how it trained (devices, "
                "batch, accumulation, sequence, precision, activation checkpointing, compile, "
                "float8) from "
                f"the run's config.json, but {spell(given[0], getattr(ns, given[0]))} was "
                f"given too. Fix: drop it, or plan without {spell('check')}.",
                field="check",
            )
        from scaletrain.planner.check import check_run

        print(check_run(ns.check, ns.hardware).table())
        return EXIT_OK
    if ns.devices is None:
        raise ConfigError(
            f"{spell('devices')} is missing: how many devices to plan for. Fix: e.g. "
            f"{spell('devices', 8)} (or {spell('check')} RUN to check a finished run).",
            field="devices",
        )
    from scaletrain.planner.api import plan

    result = plan(
        ns.recipe, model=ns.model, devices=ns.devices, hardware=ns.hardware,
        batch_size=ns.batch_size, seq_len=ns.seq_len,
        precision="32" if ns.precision is None else ns.precision,
        ac="none" if ns.ac is None else ns.ac, ac_every=ns.ac_every, compile=ns.compile,
        float8=ns.float8, accumulate=1 if ns.accumulate is None else ns.accumulate,
        progress=lambda line: print(f"scaletrain plan: {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    print(result.table())
    return EXIT_OK


def _given(ns: argparse.Namespace, flag: str) -> bool:
    """Whether the command line gave `flag` (every default is None, or False for a switch;
    a 0 given is given)."""
    value = getattr(ns, flag)
    return value is not None and value is not False
