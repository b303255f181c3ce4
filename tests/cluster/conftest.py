"""Fixtures for tests against the real tools: Slurm daemons, mpirun, namespace hosts.

Everything these tests need is installed by `make setup` (Debian packages) and
started here, never by hand: a session-wide Slurm cluster of two namespace hosts
(h1, h2) for every Slurm test, and fresh hosts for the scenarios that name their
own (Kubeflow pods, SageMaker hosts). Each fixture tears down, by pid, what it
started, even when the test fails. Without root or the tools the tests skip and
say why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from scaletrain.testing.ranks import launcher_free_env
from tests.cluster.netns import Host, Network, netns_available
from tests.cluster.slurm import SlurmCluster, slurm_available

BIN = Path(sys.executable).parent
SCALETRAIN = str(BIN / "scaletrain")
PYTHON = sys.executable

ALLREDUCE = """\
import os, socket, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("RESULT host=%s rank=%d world=%d sum=%g" % (
    socket.gethostname(), dist.get_rank(), dist.get_world_size(), t.item()), flush=True)
dist.destroy_process_group()
"""
"""Every rank prints its host, rank, world size and the all-reduced sum of rank+1."""


_RESULT = re.compile(r"RESULT host=(\S+?) rank=(\d+) world=(\d+) sum=([0-9.e+-]+)")


def results(text: str) -> list[dict[str, str]]:
    """ALLREDUCE's RESULT lines, parsed. Found anywhere in a line: the workers share one
    pipe with c10d's warnings, which C++ may write in pieces around a RESULT line."""
    keys = ("host", "rank", "world", "sum")
    return [dict(zip(keys, m.groups(), strict=True)) for m in _RESULT.finditer(text)]


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A fresh shell's environment for a job: no launcher variables, one thread, the venv
    first on PATH. Gloo's interface is NOT set: picking it is what is tested.

    SCALETRAIN_CLUSTER_SRC=DIR runs the jobs on the scaletrain under DIR (another
    checkout's src/) while the test itself runs on this one: how a scenario is shown
    to fail on older code.
    """
    env = launcher_free_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if env.get("SCALETRAIN_CLUSTER_SRC"):
        env["PYTHONPATH"] = env["SCALETRAIN_CLUSTER_SRC"]
    env.update(extra or {})
    return env


def _skip_reason() -> str | None:
    return netns_available() or slurm_available()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it, listed first: workers run in sessions of
    their own, and once their parent is gone they are no longer found below it."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except OSError:
            pass


class Procs:
    """Processes started on namespace hosts, each in its own session; killed at teardown."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.started: list[subprocess.Popen[str]] = []

    def start(
        self,
        host: Host | None,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        binds: Sequence[tuple[Path, Path]] = (),
        cwd: Path | None = None,
    ) -> subprocess.Popen[str]:
        command = list(argv) if host is None else host.command(argv, binds)
        proc = subprocess.Popen(
            command,
            env=job_env(env),
            cwd=cwd or self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc

    @staticmethod
    def wait(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
            pytest.fail(f"{proc.args} timed out after {timeout:g}s; output:\n{out[-4000:]}")
        return proc.returncode, out

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.communicate()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    started = Procs(tmp_path)
    yield started
    started.close()


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """Slurm with two nodes, h1 and h2, each its own network namespace and hostname."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="scaletrain-slurm-"))
    try:
        with Network(workdir) as net:
            hosts = [net.add_host("h1"), net.add_host("h2")]
            with SlurmCluster(workdir, net, hosts) as cluster:
                yield cluster
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def hosts_named(tmp_path: Path) -> Iterator[Callable[..., list[Host]]]:
    """hosts_named("algo-1", "algo-2") -> namespace hosts with those names."""
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    networks: list[Network] = []

    def make(*names: str) -> list[Host]:
        net = Network(tmp_path)
        networks.append(net.__enter__())
        return [net.add_host(name) for name in names]

    yield make
    for net in networks:
        net.close()
