"""`python -m scaletrain.launch` end to end: real torchrun agents and worker processes.

Each launcher runs in its own subprocess (torchrun installs signal handlers and
spawns workers; keeping that out of pytest's process is the robust choice).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

LAUNCH = ("-m", "scaletrain.launch")

RECORD_SCRIPT = """\
import json, os, sys
out = os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"])
with open(out, "w") as f:
    json.dump({k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "SCALETRAIN_T")} | {
        "argv": sys.argv[2:]}, f)
"""

ALLREDUCE_SCRIPT = """\
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], "rank%d.txt" % dist.get_rank()), "w") as f:
    f.write("%d %g" % (dist.get_world_size(), t.item()))
dist.destroy_process_group()
"""


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_two_workers_on_one_node(tmp_path: Path, start: Callable[..., Any]) -> None:
    script = write(tmp_path / "record.py", RECORD_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    result = start(
        *LAUNCH, "--nproc-per-node", "2", "--env", "SCALETRAIN_T=hello",
        script, str(out), "--lr", "3", "--nproc-per-node", "9", "--nproc", "4",
    ).wait(timeout=90)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "SCALETRAIN_T": "hello",
            # Flags torchrun knows, or abbreviates ambiguously, still belong to the script.
            "argv": ["--lr", "3", "--nproc-per-node", "9", "--nproc", "4"],
        }
    assert "Setting OMP_NUM_THREADS" not in result.stderr  # torchrun's banner is avoided


def test_module_mode(tmp_path: Path, start: Callable[..., Any]) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg / "job.py", RECORD_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    # Launched from tmp_path: the workers find mypkg as `python -m` would.
    result = start(*LAUNCH, "--nproc-per-node", "1", "-m", "mypkg.job", str(out), "x").wait(90)
    assert result.returncode == 0, result.stderr
    got = json.loads((out / "rank0.json").read_text())
    assert got["WORLD_SIZE"] == "1" and got["argv"] == ["x"]


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path: Path, port: int, start: Callable[..., Any]) -> None:
    script = write(tmp_path / "allreduce.py", ALLREDUCE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()

    def node(rank: int) -> Any:
        return start(
            *LAUNCH, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "60", script, str(out),
        )  # fmt: skip

    # Node 1 first: it waits for node 0's store instead of racing it for the port.
    node1 = node(1)
    node0 = node(0)
    results = [node0.wait(timeout=90), node1.wait(timeout=90)]
    for result in results:
        assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (out / f"rank{rank}.txt").read_text() == "2 3"  # world 2, 1 + 2


NODE_SCRIPT = """\
import json, os, sys
with open(os.path.join(sys.argv[1], "node%s.json" % sys.argv[2]), "w") as f:
    json.dump({k: os.environ[k] for k in ("RANK", "GROUP_RANK", "MASTER_ADDR")}, f)
"""


@pytest.mark.slow
def test_the_node_given_node_rank_0_holds_rank_0(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # Issue 26 (21): torch's c10d rendezvous numbers the nodes in the order of their
    # addresses, not by --node-rank: node 0 at 127.0.0.2 held rank 1, and rank 0's logs
    # appeared on the other node.
    script = write(tmp_path / "node.py", NODE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()

    def node(rank: int, addr: str) -> Any:
        return start(
            *LAUNCH, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "60",
            "--local-addr", addr, script, str(out), str(rank),
        )  # fmt: skip

    node1 = node(1, "127.0.0.1")
    node0 = node(0, "127.0.0.2")
    for result in (node0.wait(timeout=90), node1.wait(timeout=90)):
        assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        got = json.loads((out / f"node{rank}.json").read_text())
        assert (got["RANK"], got["GROUP_RANK"]) == (str(rank), str(rank)), got


PER_NODE_DRIVER = """\
import sys
from scaletrain.env.base import ClusterEnv
from scaletrain.launch import LaunchConfig, launch
rank, port, script, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
env = ClusterEnv(kind="sagemaker", rank=rank, local_rank=0, world_size=2, local_world_size=1,
                 node_rank=rank, num_nodes=2, master_addr="127.0.0.1", master_port=port,
                 per_node=True, procs_per_node_hint=1)
sys.exit(launch(LaunchConfig(rdzv_timeout=60), script, [out], env=env))
"""


@pytest.mark.slow
def test_per_node_environment_needs_no_flags(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # What SageMaker/Kubeflow do: one launcher per node, told its rank and node 0's address.
    driver = write(tmp_path / "driver.py", PER_NODE_DRIVER)
    script = write(tmp_path / "allreduce.py", ALLREDUCE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    procs = [start(driver, str(rank), str(port), script, str(out)) for rank in (1, 0)]
    for proc in procs:
        result = proc.wait(timeout=90)
        assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (out / f"rank{rank}.txt").read_text() == "2 3"


def test_failing_worker_is_summarized(tmp_path: Path, start: Callable[..., Any]) -> None:
    script = write(
        tmp_path / "fail.py",
        "import os, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('rank 1 gives up', file=sys.stderr)\n"
        "    sys.exit(3)\n",
    )
    result = start(*LAUNCH, "--nproc-per-node", "2", script).wait(timeout=90)
    assert result.returncode == 3
    assert "rank 1 gives up" in result.stderr  # the worker's own text stays visible
    assert "scaletrain launch: worker rank 1 (local rank 1, pid " in result.stderr
    assert "exited with code 3" in result.stderr and "No error file" in result.stderr
    assert "Traceback" not in result.stderr  # no launcher traceback


def test_recorded_exception_names_its_error_file(tmp_path: Path, start: Callable[..., Any]) -> None:
    script = write(
        tmp_path / "boom.py",
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise ValueError('boom from the worker')\n"
        "main()\n",
    )
    result = start(*LAUNCH, "--nproc-per-node", "1", script).wait(timeout=90)
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("scaletrain launch: worker rank 0") :]
    assert "exited with code 1" in summary
    error_file = summary.split("Error file: ")[1].splitlines()[0]
    assert error_file.startswith(str(tmp_path)) and Path(error_file).is_file()
    assert "Error: ValueError: boom from the worker" in summary
    # The worker's own traceback is printed above the summary.
    assert result.stderr.index("raise ValueError") < result.stderr.index(summary)


def test_restart_after_a_failure(tmp_path: Path, start: Callable[..., Any]) -> None:
    script = write(
        tmp_path / "flaky.py",
        "import os, sys\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    sys.exit(5)\n"
        "open(sys.argv[1], 'w').write(os.environ['TORCHELASTIC_RESTART_COUNT'])\n",
    )
    done = tmp_path / "done.txt"
    result = start(*LAUNCH, "--nproc-per-node", "1", "--max-restarts", "1", script, str(done)).wait(
        timeout=90
    )
    assert result.returncode == 0, result.stderr
    assert done.read_text() == "1"


def test_cli_error_exit_code(tmp_path: Path, start: Callable[..., Any]) -> None:
    result = start(*LAUNCH, "--nnodes", "two", "train.py").wait(timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("scaletrain launch: error: --nnodes 'two'")


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc/PID/task/*/children."""
    found, todo = [], [pid]
    while todo:
        each = todo.pop()
        found.append(each)
        for task in Path(f"/proc/{each}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _listening(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket the processes hold."""
    import ipaddress

    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # /proc/net prints each 32-bit word in host (little-endian) order.
            ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((inodes[fields[9]], str(ipaddress.ip_address(ordered))))
    return found


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


@pytest.mark.slow
@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_single_node_run_listens_on_loopback_only(
    tmp_path: Path, start: Callable[..., Any], restarts: str
) -> None:
    # Issue 26 (23): the agent's two stores (unauthenticated TCPStores) listened on every
    # interface for the whole run. With --max-restarts the workers' rank 0 opens the
    # job's store instead of the agent.
    run = tmp_path / "run"
    train = start(
        "-m", "scaletrain", "train", "--recipe", "split-net", "--max-steps", "100000",
        "--log-every", "1", "--out", str(run), "--max-restarts", restarts,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert train.popen.poll() is None, train.wait(5).stderr
        assert time.monotonic() < deadline, "the run did not reach its first steps"
        time.sleep(0.2)
    pids = _tree(train.popen.pid)
    try:
        sockets = _listening(pids)
    finally:
        for pid in reversed(pids):  # workers run in sessions of their own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        train.popen.communicate()
    assert len(pids) >= 3 and len(sockets) >= 2, (pids, sockets)
    assert all(_loopback(address) for _, address in sockets), sockets
