"""`scaletrain plan`: its flags and its run (the CLI's words for st.plan and
`plan --check`)."""

from __future__ import annotations

import argparse

from scaletrain.errors import ConfigError, spell
from scaletrain.exitcodes import EXIT_OK

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="memory per device and step time of every strategy at N devices",
        description=(
            "Predict, for every strategy and mesh of N devices (ddp, fsdp, tensor, pipeline, "
            "fsdp x tp, ddp x pp), the memory per device and the step time, from the model "
            "itself; recommend the fastest that fits. Without --hardware this machine is "
            "measured (10-60 s on 2 CPU cores). --check RUN compares a finished run with its "
            "prediction."
        ),
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--recipe", metavar="R", default=None, help="a recipe (default convnet)")
    which.add_argument(
        "--model", metavar="MODULE:FACTORY", default=None,
        help="any model: FACTORY() builds it, MODULE.example(batch_size) gives a batch",
    )  # fmt: skip
    p.add_argument("--devices", metavar="N", type=int, default=None, help="devices in all")
    p.add_argument("--nodes", metavar="M", type=int, default=1, help="nodes they are on")
    p.add_argument(
        "--hardware", metavar="PROFILE", default=None,
        help="h100-sxm, a100-sxm, a100-pcie or ethernet (datasheet); default: this machine "
        "measured (its GPU where it has one, else its CPU)",
    )  # fmt: skip
    p.add_argument("--batch-size", metavar="B", type=int, default=None, help="per replica")
    p.add_argument("--precision", metavar="P", default="32", help="32, bf16-mixed, ...")
    p.add_argument(
        "--device", metavar="D", default=None,
        help="without --hardware: what to measure, cpu or cuda (default: this machine's GPU "
        "where it has one, else its CPU)",
    )  # fmt: skip
    p.add_argument(
        "--mfu", metavar="F", type=float, default=None,
        help="with --hardware: the fraction of datasheet peak a step reaches (default 0.4; "
        "a run's measured MFU is in its ledger summary)",
    )  # fmt: skip
    p.add_argument(
        "--ac", choices=("none", "full", "selective"), default="none",
        help="activation checkpointing, as scaletrain train takes it (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--ac-every", metavar="K", type=int, default=None,
        help="with --ac selective: every K-th block checkpointed whole",
    )  # fmt: skip
    p.add_argument("--check", metavar="RUN", default=None, help="a finished run to check")


def run_plan(ns: argparse.Namespace) -> int:
    given = [
        f
        for f in ("recipe", "model", "devices", "hardware", "batch_size", "mfu", "device")
        if getattr(ns, f)
    ]
    if ns.check is not None:
        from scaletrain.spellings import canonical

        if ns.nodes != 1:
            given.append("nodes")
        if canonical("precision", ns.precision) != "32":
            given.append("precision")
        if given:
            extra = spell(given[0], getattr(ns, given[0]))
            raise ConfigError(
                f"{spell('check', ns.check)} takes the model, devices and batch from the run's "
                f"config.json, but {extra} was given too. Fix: drop it, or plan without "
                f"{spell('check')}.",
                field="check",
            )
        from scaletrain.train.planning import check_run

        print(check_run(ns.check).table())
        return EXIT_OK
    if ns.devices is None:
        raise ConfigError(
            f"{spell('devices')} is missing: how many devices to plan for. Fix: e.g. "
            f"{spell('devices', 4)} (or {spell('check')} RUN to check a finished run).",
            field="devices",
        )
    from scaletrain.train.planning import plan

    result = plan(
        ns.recipe, model=ns.model, devices=ns.devices, nodes=ns.nodes, hardware=ns.hardware,
        batch_size=ns.batch_size, precision=ns.precision, mfu=ns.mfu, device=ns.device,
        ac=ns.ac, ac_every=ns.ac_every,
    )  # fmt: skip
    print(result.table())
    return EXIT_OK
