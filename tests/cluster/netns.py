"""Several "hosts" on one machine: network namespaces on a bridge, each with its own name.

A `Network` is a Linux bridge in the test's own namespace (the "login node", where
pytest, slurmctld, srun and sbatch run) with an address on it; every `Host` is a
network namespace joined to the bridge by a veth pair whose inner end is called
eth0, as on a real machine. Processes run on a host through `Host.command(...)`:
`nsenter --net` into its namespace (not `ip netns exec`, which remounts /sys and
hides the cgroup files slurmd reads), then `unshare --uts --mount` so the host has
its own hostname and its own /etc/hosts, bind-mounted from a file of the test's.

Each host's /etc/hosts is what Debian writes by default: the host's own name on
127.0.1.1 and the other hosts on their real addresses. Gloo, left alone, binds the
address the hostname resolves to and tells its peers to connect there: 127.0.1.1,
which no peer can reach. The cluster tests run in exactly that setting.

Everything is named after the test process's pid, so two test sessions on one
machine never share a namespace or a bridge, and `close()` deletes only what this
one made (namespaces take their processes' sockets, veths and routes with them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "Network", "netns_available"]

_PREFIX = "st"


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


def netns_available() -> str | None:
    """None where namespaces can be made here, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs iproute2 and util-linux)"
    probe = f"{_PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or "").strip() or f"exit status {exc.returncode}"
        return f"cannot create a network namespace here (`ip netns add`: {said})"
    except OSError as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    """One namespace host: its name, address and the hosts file it sees as /etc/hosts."""

    name: str
    addr: str
    netns: str
    hosts_file: Path
    network: Network = field(repr=False)

    def command(self, argv: Sequence[str], binds: Sequence[tuple[Path, Path]] = ()) -> list[str]:
        """`argv` run on this host: in its namespace, under its hostname, with its hosts file.

        `binds` (source, target) mount a directory of the test over another path in this
        host's mount namespace only: a disk of its own, as a node without a shared
        filesystem has.
        """
        mounts = "".join(f" && mount --bind {src} {dst}" for src, dst in binds)
        setup = (
            f"hostname {self.name} && mount --bind {self.hosts_file} /etc/hosts{mounts} && "
            'exec "$@"'
        )
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            setup,
            "sh",
            *argv,
        ]

    def write_hosts(self, entries: Sequence[tuple[str, str]]) -> None:
        """Rewrite this host's /etc/hosts in place (the bind mount follows the inode)."""
        lines = ["127.0.0.1 localhost", *(f"{addr} {name}" for addr, name in entries)]
        with open(self.hosts_file, "r+", encoding="utf-8") as f:
            f.truncate(0)
            f.write("\n".join(lines) + "\n")


class Network:
    """A bridge with an address in this namespace and hosts attached to it."""

    _made = 0

    def __init__(self, workdir: Path) -> None:
        pid = os.getpid()
        Network._made += 1
        serial = Network._made
        # 10.213.X.0/24, X from the pid and a serial: concurrent sessions, and several
        # networks of one session, get different subnets and device names.
        self.subnet = 16 + (pid * 7 + serial) % 200
        self.tag = f"{_PREFIX}{pid % 100000}{chr(ord('a') + serial % 26)}"
        self.bridge = f"{self.tag}br"
        self.gateway = f"10.213.{self.subnet}.254"
        self.workdir = workdir
        self.hosts: list[Host] = []
        self._made_bridge = False

    def __enter__(self) -> Network:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        netns = f"{self.tag}h{index}"
        outer, inner = f"{self.tag}v{index}", f"{self.tag}p{index}"
        addr = f"10.213.{self.subnet}.{index}"
        _ip("netns", "add", netns)
        host = Host(name, addr, netns, self.workdir / f"hosts-{name}", self)
        self.hosts.append(host)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", netns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("link", "set", inner, "name", "eth0", netns=netns)
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        host.hosts_file.write_text("")
        for each in self.hosts:
            each.write_hosts(self.debian_hosts(each))
        return host

    def debian_hosts(self, host: Host) -> list[tuple[str, str]]:
        """/etc/hosts as Debian writes it: own name on 127.0.1.1, the others by address."""
        return [("127.0.1.1", host.name)] + [
            (other.addr, other.name) for other in self.hosts if other is not host
        ]

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", host.netns)
        self.hosts.clear()
        if self._made_bridge:
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("link", "del", self.bridge)
            self._made_bridge = False
