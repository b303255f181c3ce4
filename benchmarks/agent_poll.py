"""What the elastic agent's --monitor-interval costs, and what a longer one costs instead.

torchrun (and so `scaletrain launch` / `scaletrain train`) runs an agent process that
wakes every --monitor-interval seconds to check its workers. Here the workers only sleep,
so everything the agent process spends between two readings of its CPU time (from
/proc, seconds 12 to 27 of a 30 s job) is the polling's own cost; the exit latency is
how long after the last worker finished the launcher returned (a finished or dead worker
is noticed at the next check). Rounds interleave the intervals.

    .venv/bin/python benchmarks/agent_poll.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, time
time.sleep(float(os.environ["SLEEP_S"]))
open(os.environ["END_FILE"] + os.environ["RANK"], "w").write(repr(time.time()))
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--intervals", default="0.1,0.5,1,5", help="seconds, comma-separated")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    intervals = a.intervals.split(",")
    print(f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[str, list[tuple[float, float]]] = {i: [] for i in intervals}
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        for r in range(a.rounds):
            for interval in intervals:
                end = f"{tmp}/end{interval}_{r}_"
                env = dict(os.environ, OMP_NUM_THREADS="1", SLEEP_S="30", END_FILE=end)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={a.nproc}", "--monitor-interval", interval, str(worker)]  # fmt: skip
                proc = subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                time.sleep(12)
                c0 = _cpu_s(proc.pid)
                time.sleep(15)
                c1 = _cpu_s(proc.pid)
                proc.wait()
                done = time.time()
                last = max(float(Path(end + str(k)).read_text()) for k in range(a.nproc))
                results[interval].append(((c1 - c0) / 15 * 1e3, done - last))
                print(f"round {r + 1} interval {interval}: agent {results[interval][-1][0]:.1f} "
                      f"ms CPU/s, exit latency {results[interval][-1][1]:.2f} s", flush=True)  # fmt: skip
    print("\n| --monitor-interval s | agent CPU ms per s (median) | exit latency s (median) |")
    print("|---:|---:|---:|")
    for interval, rows in results.items():
        cpu = statistics.median(x for x, _ in rows)
        latency = statistics.median(y for _, y in rows)
        print(f"| {interval} | {cpu:.1f} | {latency:.2f} |")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
