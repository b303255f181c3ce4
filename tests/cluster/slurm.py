"""A real Slurm 22.05 (Debian's slurm-wlm) started by the tests: slurmctld here, slurmd per host.

slurmctld runs in the test's own namespace (the "login node", where srun and sbatch
are typed) and one slurmd runs on each namespace host (tests/cluster/netns.py), so
a two-node job is two machines as far as Slurm, torch and Gloo can tell.

Settings that work without systemd, cgroups or munge (measured on Debian bookworm):
`AuthType=auth/none` and `CredType=cred/none` (no munged), `ProctrackType=
proctrack/linuxproc` and `TaskPlugin=task/none` (no cgroup plugins), and
`SlurmdParameters=config_overrides` so the CPUs declared here count rather than the
machine's: a step asking for more tasks than CPUs waits forever otherwise. Every
state, spool, log and pid file lives in the test's directory; clients find the
cluster through SLURM_CONF.

Teardown is by pid: the daemons this object started, then any process whose
environment carries this cluster's SLURM_CONF (the job steps and their tasks,
which slurmstepd starts outside the daemons' process groups).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.cluster.netns import Host, Network

__all__ = ["SlurmCluster", "slurm_available"]

_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
CPUS_PER_NODE = 4


def slurm_available() -> str | None:
    """None where Slurm's daemons and clients are installed, else why not."""
    import shutil

    for tool in _TOOLS:
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} is not installed (make setup installs slurmctld slurmd slurm-client)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """slurmctld on the network's gateway, one slurmd per host, a partition `test`."""

    def __init__(self, workdir: Path, network: Network, hosts: Sequence[Host]) -> None:
        self.workdir = workdir
        self.network = network
        self.hosts = list(hosts)
        self.conf = workdir / "slurm.conf"
        self._daemons: list[subprocess.Popen[bytes]] = []

    # -- configuration ------------------------------------------------------------------
    def _write_conf(self) -> None:
        d = self.workdir
        (d / "state").mkdir(exist_ok=True)
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.addr} CPUs={CPUS_PER_NODE} RealMemory=2000 "
            "State=UNKNOWN"
            for h in self.hosts
        )
        self.conf.write_text(
            f"""\
ClusterName=scaletrain
SlurmctldHost={socket.gethostname()}({self.network.gateway})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
MinJobAge=600
KillWait=10
InactiveLimit=0
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Variables for a client command (srun, sbatch, scontrol) of this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # -- life cycle -----------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, argv: Sequence[str], log: Path) -> None:
        with open(log, "ab") as out:
            self._daemons.append(
                subprocess.Popen(
                    list(argv),
                    env=self.env(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def start(self, timeout: float = 60.0) -> None:
        self._write_conf()
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], self.workdir / "ctld.out")
        for host in self.hosts:
            self._spawn(
                host.command(["slurmd", "-D", "-N", host.name, "-f", str(self.conf)]),
                self.workdir / f"slurmd-{host.name}.out",
            )
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args} exited with {proc.returncode}: {self.logs()}")
            got = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=20,
            )
            states = got.stdout.strip()
            lines = [line.split() for line in states.splitlines()]
            if len(lines) == len(self.hosts) and all(s == "idle" for _, s in lines):
                return
            time.sleep(0.2)
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        raise RuntimeError(
            f"Slurm nodes not idle after {timeout:g}s: {states!r}\n"
            f"--- ip -4 route (slurmctld on {self.network.gateway}) ---\n{routes}{self.logs()}"
        )

    def logs(self) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")) + sorted(self.workdir.glob("*.out")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def _our_processes(self) -> list[int]:
        """Pids whose environment names this cluster's configuration (steps, tasks)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        me = os.getpid()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(
                ["scancel", "--full", "--partition", "test"],
                env=self.env(),
                capture_output=True,
                timeout=10,
            )
        for proc in self._daemons:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self._daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._daemons.clear()
        for pid in self._our_processes():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    # -- clients --------------------------------------------------------------------------
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """A client command (srun ..., sbatch ...) bounded by `timeout` (coreutils' timeout)."""
        return subprocess.run(
            ["timeout", "-k", "5", str(int(timeout)), *argv],
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout + 15,
        )

    def sbatch(self, script: Path, *args: str, env: Mapping[str, str] | None = None) -> int:
        """Submit `script` from its directory; the job id."""
        got = self.run(["sbatch", "--parsable", *args, str(script)], timeout=30, env=env,
                       cwd=script.parent)  # fmt: skip
        if got.returncode != 0:
            raise RuntimeError(f"sbatch failed: {got.stderr}")
        return int(got.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        got = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=20)
        return dict(re.findall(r"(\w+)=(\S*)", got.stdout))

    def wait_job(self, job_id: int, timeout: float, states: Sequence[str] = ()) -> dict[str, str]:
        """Wait until the job reaches one of `states` (default: any finished state)."""
        final = states or (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        )
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in final:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:g}s: {info}")
