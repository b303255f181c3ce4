"""The agent's first rendezvous on one node, with and without launch/fastjoin.py's patches.

Each run is a fresh `python` that imports torch's launcher, starts torchrun's agent
(`--standalone --nproc-per-node 2`, as `scaletrain launch` on one machine) and stops at
the moment the agent would start its workers: the time from the agent's start to
there is the rendezvous. Runs alternate between the two variants, so the machine's
load hits both alike; printed: each variant's median, min and max, and their ratio.

    .venv/bin/python benchmarks/rendezvous_start.py --runs 8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
from torch.distributed import run
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

def stop_here(self, worker_group):
    print(time.perf_counter() - T0, flush=True)
    os._exit(0)

LocalElasticAgent._start_workers = stop_here
argv = ["--standalone", "--nproc-per-node", "2", sys.executable]
if sys.argv[1] == "fast":
    from scaletrain.launch.fastjoin import fast_rendezvous
    with fast_rendezvous(single_node=True):
        T0 = time.perf_counter()
        run.main(argv)
else:
    T0 = time.perf_counter()
    run.main(argv)
"""


def _once(variant: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant],
        capture_output=True, text=True, check=True, timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=8, help="runs of each variant (default: 8)")
    a = ap.parse_args()
    print(
        f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    times: dict[str, list[float]] = {"torch as it is": [], "fastjoin": []}
    for _ in range(a.runs):
        times["torch as it is"].append(_once("plain"))
        times["fastjoin"].append(_once("fast"))
    print("\n| variant | median ms | min | max |\n|---|---:|---:|---:|")
    for name, t in times.items():
        print(
            f"| {name} | {statistics.median(t) * 1e3:.1f} | {min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} |"
        )
    ratio = statistics.median(times["torch as it is"]) / statistics.median(times["fastjoin"])
    print(f"\nagent start to workers' start: {ratio:.1f}x shorter with fastjoin (medians)")


if __name__ == "__main__":
    main()
