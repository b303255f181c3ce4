"""scaletrain against its peers, side by side in one run: the same training everywhere.

Every contender trains the seeds' ConvNet on Fashion-MNIST with SGD, batch --batch-size
per rank, --nproc Gloo ranks, --steps steps, the same initial weights, data order and
learning rates (benchmarks/contenders/common.py), so all must end with the same loss;
one that does not is marked WRONG and its speed does not count.

  raw         hand-written DDP + DistributedSampler under torchrun (the baseline)
  raw-mi5     the same, torchrun --monitor-interval 5 (the agent polls its workers less)
  raw-shell   the same script, ranks started by this program (no elastic agent at all)
  lib         the same loop on scaletrain's library, under `scaletrain launch`
  train       `scaletrain train` (the Trainer, its dataset, the ledger and the watchdog)
  accelerate  Hugging Face Accelerate under torchrun        } only if benchmarks/.venv-peers
  fabric      Lightning Fabric, its own launcher             } exists (`make peers-venv`)
  train-base  `scaletrain train` from another source tree (--baseline-src DIR: before/after)

Rounds interleave the contenders (each round in a rotated order) so the machine's noise
hits all alike. Per contender: median/min/max samples/s over rounds (training steps
after --skip, wall clock of the slowest rank), the median of the per-round ratios to raw
("paired": cancels drift between rounds), CPU seconds per step per rank (less sensitive
to other jobs than wall time), CPU of the whole command (launcher included) and startup
to the first step (from the command's start to the end of every rank's first step).

    .venv/bin/python benchmarks/peers.py                           # the full comparison
    .venv/bin/python benchmarks/peers.py --rounds 3 --steps 150    # a few minutes
    .venv/bin/python benchmarks/peers.py --scaling 1,2,4 --only raw,train
    git archive main src | tar -x -C /tmp/base   # then, old code against new:
    .venv/bin/python benchmarks/peers.py --only raw,train --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks" / "contenders"
PEERS_PY = ROOT / "benchmarks" / ".venv-peers" / "bin" / "python"
FMNIST = "/usr/share/datasets/fashion-mnist"
ALL = ("raw", "raw-mi5", "raw-shell", "lib", "train", "accelerate", "fabric")
NEEDS_PEERS_VENV = ("accelerate", "fabric")
LOSS_RTOL = 1e-3


@dataclass
class Sample:
    samples_per_s: float
    rank_cpu_ms: float
    command_cpu_s: float
    startup_s: float
    loss: float
    phases: dict[str, float] = field(default_factory=dict)
    """The step ledger's median ms per phase (scaletrain's contenders only)."""


@dataclass
class Contender:
    name: str
    results: list[Sample] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(py: str, nproc: int, *extra: str) -> list[str]:
    return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra]


def _command(name: str, a: argparse.Namespace, nproc: int, tmp: Path) -> list[list[str]]:
    """The command(s) that start contender `name`; several: one per rank (raw-shell)."""
    script = [
        "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--data-dir", a.data_dir,
        "--record", str(tmp / "rec"), "--ranks", str(nproc),
    ]  # fmt: skip
    py = sys.executable
    if name == "raw":
        return [_torchrun(py, nproc, str(HERE / "raw_ddp.py"), *script)]
    if name == "raw-mi5":
        return [_torchrun(py, nproc, "--monitor-interval", "5", str(HERE / "raw_ddp.py"), *script)]
    if name == "raw-shell":
        return [[py, str(HERE / "raw_ddp.py"), *script] for _ in range(nproc)]
    if name == "lib":
        launch = [py, "-m", "scaletrain", "launch", "--nproc-per-node", str(nproc)]
        if a.monitor_interval is not None:
            launch += ["--monitor-interval", str(a.monitor_interval)]
        return [[*launch, str(HERE / "scaletrain_ddp.py"), *script]]
    if name in ("train", "train-base"):
        cmd = [
            py, "-m", "scaletrain", "train", "--nproc", str(nproc), "--max-steps", str(a.steps),
            "--epochs", "1000", "--batch-size", str(a.batch_size), "--eval-batches", "0",
            "--data-dir", a.data_dir, "--out", str(tmp / "run"),
        ]  # fmt: skip
        if a.monitor_interval is not None and name == "train":
            cmd += ["--monitor-interval", str(a.monitor_interval)]
        return [cmd]
    if name == "accelerate":
        return [_torchrun(str(PEERS_PY), nproc, str(HERE / "accelerate_ddp.py"), *script)]
    if name == "fabric":
        return [[str(PEERS_PY), str(HERE / "fabric_ddp.py"), *script]]
    raise AssertionError(name)


def _records(
    name: str, tmp: Path, nproc: int
) -> tuple[list[list[float]], list[list[float]], float]:
    """Every rank's end-of-step times and cumulative CPU seconds, and rank 0's final loss
    (the mean of its last 20 steps)."""
    if name not in ("train", "train-base"):
        recs = [json.loads((tmp / f"rec.rank{r}.json").read_text()) for r in range(nproc)]
        return [r["t"] for r in recs], [r["cpu"] for r in recs], float(recs[0]["loss"])
    times, cpus = [], []
    for r in range(nproc):
        lines = (tmp / "run" / "observe" / f"rank{r}.jsonl").read_text().splitlines()
        steps = [rec for rec in map(json.loads, lines) if rec.get("kind") == "step"]
        times.append([s["t"] for s in steps])
        total, cum = 0.0, []
        for s in steps:
            total += s["cpu"]
            cum.append(total)
        cpus.append(cum)
    metrics = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    last = [m for m in map(json.loads, metrics) if m.get("event") == "train"][-1]
    return times, cpus, float(last["loss"])


def run_once(name: str, a: argparse.Namespace, nproc: int) -> Sample:
    tmp = Path(tempfile.mkdtemp(prefix=f"peers-{name}-"))
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        env["PYTHONPATH"] = str(HERE)
        env["SCALETRAIN_RUN_DIR"] = str(tmp / "run")  # where the library's ledger writes
        if name == "train-base":
            env["PYTHONPATH"] = f"{a.baseline_src}{os.pathsep}{HERE}"
        cmds = _command(name, a, nproc, tmp)
        if len(cmds) > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.time()
        procs, logs = [], []
        for rank, cmd in enumerate(cmds):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if len(cmds) > 1 else env
            logs.append((tmp / f"out{rank}.txt").open("w"))  # a file: no pipe fills and blocks
            procs.append(
                subprocess.Popen(
                    cmd, cwd=tmp, env=rank_env, stdout=logs[-1], stderr=subprocess.STDOUT
                )
            )
        for proc in procs:
            proc.wait(timeout=a.timeout)
        for log in logs:
            log.close()
        outputs = [(tmp / f"out{rank}.txt").read_text() for rank in range(len(cmds))]
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if any(p.returncode for p in procs):
            codes = [p.returncode for p in procs]
            sys.exit(f"{name} failed (exit {codes}): {cmds[0]}\n" + "\n".join(outputs)[-4000:])
        times, cpus, loss = _records(name, tmp, nproc)
        phases = _ledger_phases(tmp / "run")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    k = a.skip
    n = len(times[0]) - 1 - k
    wall = max(t[-1] for t in times) - max(t[k] for t in times)
    cpu = statistics.mean((c[-1] - c[k]) / n for c in cpus)
    command_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Sample(
        samples_per_s=n * a.batch_size * nproc / wall,
        rank_cpu_ms=cpu * 1e3,
        command_cpu_s=command_cpu,
        startup_s=max(t[0] for t in times) - start,
        loss=loss,
        phases=phases,
    )


def _ledger_phases(run: Path) -> dict[str, float]:
    """Median ms per phase over the counted steps of every rank (empty without a ledger)."""
    ranks = sorted((run / "observe").glob("rank*.jsonl"))
    if not ranks:
        return {}
    names: list[str] = []
    rows: list[list[float]] = []
    for path in ranks:
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec.get("kind") == "run":
                names = rec["phases"]
            elif rec.get("kind") == "step" and not rec.get("flags"):
                rows.append([*rec["p"], rec["wall"], rec["cpu"]])
    if not rows:
        return {}
    cols = [*names, "step", "cpu"]
    return {c: 1e3 * statistics.median(r[i] for r in rows) for i, c in enumerate(cols)}


def _rounds(names: list[str], a: argparse.Namespace, nproc: int) -> dict[str, Contender]:
    table = {n: Contender(n) for n in names}
    for i in range(a.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            table[name].results.append(run_once(name, a, nproc))
        line = ", ".join(f"{n} {table[n].results[-1].samples_per_s:,.0f}" for n in names)
        print(f"round {i + 1}/{a.rounds} ({nproc} proc): {line}  [load {_load()}]", flush=True)
    return table


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _print_peers(table: dict[str, Contender], a: argparse.Namespace) -> bool:
    base = table["raw"].results
    ref_loss = base[0].loss
    print(
        "\n| contender | samples/s median | min | max | vs raw | paired vs raw | "
        "CPU ms/step/rank | CPU vs raw | command CPU s | startup s | final loss | same loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    all_same = True
    for c in table.values():
        sps = [s.samples_per_s for s in c.results]
        paired = [s.samples_per_s / b.samples_per_s for s, b in zip(c.results, base, strict=True)]
        cpu = _med([s.rank_cpu_ms for s in c.results])
        losses = [s.loss for s in c.results]
        same = all(abs(x - ref_loss) <= LOSS_RTOL * abs(ref_loss) for x in losses)
        all_same &= same
        print(
            f"| {c.name} | {_med(sps):,.0f} | {min(sps):,.0f} | {max(sps):,.0f} | "
            f"{_med(sps) / _med([b.samples_per_s for b in base]):.2f} | "
            f"{_med(paired):.2f} ({min(paired):.2f}-{max(paired):.2f}) | {cpu:.1f} | "
            f"{_med([b.rank_cpu_ms for b in base]) / cpu:.2f} | "
            f"{_med([s.command_cpu_s for s in c.results]):.1f} | "
            f"{_med([s.startup_s for s in c.results]):.1f} | {_med(losses):.5f} | "
            f"{'yes' if same else 'WRONG'} |"
        )
    print(
        "\nvs raw: ratio of medians; paired: median (range) of each round's ratio; CPU vs raw: "
        "raw's CPU per step over this one's (> 1: cheaper). same loss: within "
        f"{LOSS_RTOL:g} of raw's (rank 0's mean loss over its last 20 steps)."
    )
    ledgers = {n: c for n, c in table.items() if all(s.phases for s in c.results)}
    if ledgers:
        cols = [k for k in next(iter(ledgers.values())).results[0].phases]
        cols = [k for k in cols if any(_med([s.phases.get(k, 0) for s in c.results]) >= 0.05
                                       for c in ledgers.values())]  # fmt: skip
        print(
            "\nThe step ledger (median ms per step over rounds of the median over ranks x steps):"
        )
        print("| contender | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for n, c in ledgers.items():
            cells = [f"{_med([s.phases.get(k, 0.0) for s in c.results]):.1f}" for k in cols]
            print(f"| {n} | " + " | ".join(cells) + " |")
    return all_same


def _print_scaling(by_n: dict[int, dict[str, Contender]], names: list[str]) -> None:
    counts = sorted(by_n)
    head = " | ".join(f"{n} proc samples/s (x, eff)" for n in counts)
    print(f"\n| contender | {head} |")
    print("|---|" + "---:|" * len(counts))
    for name in names:
        one = _med([s.samples_per_s for s in by_n[counts[0]][name].results])
        cells = []
        for n in counts:
            sps = _med([s.samples_per_s for s in by_n[n][name].results])
            cells.append(f"{sps:,.0f} ({sps / one:.2f}x, {sps / one / (n / counts[0]):.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(
        f"\nx: samples/s against {counts[0]} process(es); eff: that over the process ratio. "
        f"This machine has {os.cpu_count()} cores: more processes than cores share them."
    )


def _autogroup() -> str:
    try:
        return (
            "on"
            if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
            else "off"
        )
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    p.add_argument("--skip", type=int, default=10, help="first steps not timed (default: 10)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--batch-size", type=int, default=100, help="samples per rank per step")
    p.add_argument(
        "--data-dir", default=FMNIST, help=f"Fashion-MNIST IDX files (default: {FMNIST})"
    )
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(ALL)}")
    p.add_argument(
        "--monitor-interval", type=float, default=None,
        help="pass --monitor-interval S to `scaletrain launch` and `scaletrain train`",
    )  # fmt: skip
    p.add_argument(
        "--baseline-src", default=None, metavar="DIR",
        help="also run `scaletrain train` with scaletrain imported from DIR (train-base)",
    )  # fmt: skip
    p.add_argument("--scaling", default=None, metavar="N,N,...", help="process counts to compare")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before giving up")
    a = p.parse_args(argv)
    if a.steps <= a.skip + 20:
        p.error(f"--steps {a.steps} must exceed --skip {a.skip} + 20 (the loss window)")
    if not Path(a.data_dir).is_dir():
        p.error(f"--data-dir {a.data_dir}: no such directory (`make setup` installs it)")
    names = list(ALL) if a.only is None else [n.strip() for n in a.only.split(",")]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        p.error(f"--only: unknown contender(s) {unknown}; expected some of {','.join(ALL)}")
    if "raw" not in names:
        names.insert(0, "raw")
    if a.baseline_src is not None:
        if not (Path(a.baseline_src) / "scaletrain" / "__init__.py").is_file():
            p.error(f"--baseline-src {a.baseline_src}: expected a directory holding scaletrain/")
        names.append("train-base")
    if not PEERS_PY.exists():
        for n in [n for n in names if n in NEEDS_PEERS_VENV]:
            print(f"note: {n} skipped: no {PEERS_PY} (run `make peers-venv` to compare with it)")
            names.remove(n)
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, load average {_load()}, "
        f"autogroup scheduling {_autogroup()}"
    )
    print(f"command: {' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}")
    if a.scaling is not None:
        counts = [int(x) for x in a.scaling.split(",")]
        names = [n for n in names if n not in ("raw-shell", "fabric")] or ["raw"]
        by_n = {n: _rounds(names, a, n) for n in counts}
        _print_scaling(by_n, names)
        print(f"load average at the end: {_load()}")
        return 0
    table = _rounds(names, a, a.nproc)
    same = _print_peers(table, a)
    print(f"load average at the end: {_load()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
