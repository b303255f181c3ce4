"""A node lost: its worker ends with its launcher, and the other node says what happened.

Two launchers on loopback stand for two nodes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

SLEEPER = """\
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_worker_dies_with_a_killed_agent(tmp_path: Path, start: Callable[..., Any]) -> None:
    # Issue 10 (6): the worker went on as an orphan (torch starts workers in sessions of
    # their own and never tells them when the agent dies).
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pid_file = tmp_path / "worker.pid"
    agent = start("-m", "scaletrain.launch", "--nproc-per-node", "1", str(script), str(pid_file))
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    try:
        os.kill(agent.popen.pid, signal.SIGKILL)
        agent.popen.wait()  # (its pipes stay open while an orphan holds them)
        deadline = time.monotonic() + 10
        while _alive(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its agent"
            time.sleep(0.1)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


LOOPER = """\
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
open(sys.argv[1] + str(dist.get_rank()), "w").write("up")
for _ in range(600):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_a_node_that_does_not_come_back_is_not_a_rendezvous_that_never_formed(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # Issue 10 (5): after a node was killed, the other one's restart waited out the
    # rendezvous and said it "did not complete ... start the launcher on every node".
    script = tmp_path / "looper.py"
    script.write_text(LOOPER)
    marker = tmp_path / "up"

    def node(rank: int) -> Any:
        return start(
            "-m", "scaletrain.launch", "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "10",
            "--nproc-per-node", "1", "--max-restarts", "1", str(script), str(marker),
        )  # fmt: skip

    node1 = node(1)
    node0 = node(0)
    deadline = time.monotonic() + 60
    while not (Path(f"{marker}0").exists() and Path(f"{marker}1").exists()):
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    os.kill(node1.popen.pid, signal.SIGKILL)
    node1.popen.wait()
    result = node0.wait(timeout=90)
    assert result.returncode == 1, result.stderr
    assert "after the workers stopped (a worker failed, or a node left)" in result.stderr
    assert "round 2" in result.stderr and "did not complete" not in result.stderr


ONE_FAILS = """\
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if sys.argv[1] == "0":  # the node that hosts the store
    print("node 0 gives up", file=sys.stderr)
    dist.destroy_process_group()
    sys.exit(3)
time.sleep(60)  # node 1's worker goes on, as one waiting in a collective would
"""

BOTH_FAIL = """\
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print("node %s refuses" % sys.argv[1], file=sys.stderr)
dist.destroy_process_group()  # (left to exit, Gloo may abort when its peer is gone first)
sys.exit(3)  # every rank at once: a refusal made after a gather (a split model on a disk per node)
"""


SLOW_TO_FAIL = BOTH_FAIL.replace(
    "sys.exit(3)", "time.sleep(5 if sys.argv[1] == '1' else 0); sys.exit(3)"
).replace("import sys,", "import sys, time,")
"""As BOTH_FAIL, but node 1's worker takes 5 s to exit (a loaded node's teardown)."""


def _two_nodes(tmp_path: Path, port: int, start: Callable[..., Any], text: str) -> list[Any]:
    script = tmp_path / "job.py"
    script.write_text(text)

    def node(rank: int) -> Any:
        return start(
            "-m", "scaletrain.launch", "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "30",
            "--nproc-per-node", "1", str(script), str(rank),
        )  # fmt: skip

    node1 = node(1)  # first: it waits for node 0's store instead of racing it for the port
    node0 = node(0)
    return [node0.wait(timeout=90), node1.wait(timeout=90)]


@pytest.mark.slow
def test_when_the_store_node_fails_the_other_says_so_not_that_the_rendezvous_never_formed(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # Node 0 hosts the store; its worker failed and its launcher exited while node 1's
    # worker ran. Node 1 said "The rendezvous ... did not complete ... start the
    # launcher on every node", although the job had formed and run.
    node0, node1 = _two_nodes(tmp_path, port, start, ONE_FAILS)
    assert node0.returncode == 3 and "node 0 gives up" in node0.stderr
    assert node1.returncode == 1, node1.stderr
    assert "did not complete" not in node1.stderr
    assert "node 0 (it hosts the rendezvous store" in node1.stderr
    assert "its own output says why" in node1.stderr


@pytest.mark.slow
def test_a_failure_on_every_node_is_each_nodes_own(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # Every worker fails at once (as the refusal of a split model on a disk per node):
    # node 0, which hosts the store, waits a moment before it exits, so node 1 reports
    # its own worker's failure rather than the store gone.
    node0, node1 = _two_nodes(tmp_path, port, start, BOTH_FAIL)
    for rank, result in enumerate((node0, node1)):
        assert result.returncode == 3, result.stderr
        assert f"node {rank} refuses" in result.stderr
        assert "exited with code 3" in result.stderr
        assert "did not complete" not in result.stderr and "went away" not in result.stderr


@pytest.mark.slow
def test_the_store_stays_until_every_node_has_its_result(
    tmp_path: Path, port: int, start: Callable[..., Any]
) -> None:
    # Issue 26 (21): node 0 ended the store 2 s after its own workers failed; node 1,
    # whose worker took longer to fail, then found the store gone and said node 0 went
    # away instead of its own worker's refusal. The store now stays until every node
    # has ended.
    node0, node1 = _two_nodes(tmp_path, port, start, SLOW_TO_FAIL)
    for rank, result in enumerate((node0, node1)):
        assert result.returncode == 3, result.stderr
        assert f"node {rank} refuses" in result.stderr and "exited with code 3" in result.stderr
        assert "went away" not in result.stderr and "did not complete" not in result.stderr
