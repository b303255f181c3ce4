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

Everything is named after the test process's pid, and `close()` deletes only what
this session made (namespaces take their processes' sockets, veths and routes with
them). A session killed before its teardown leaves its bridge, namespaces and subnet
behind, and pids repeat (a recycled pid, a container's pid namespace): a network
therefore claims a bridge name that does not exist yet and a subnet that no address
or route of this machine uses. A second bridge on a subnet in use would leave the
kernel two routes to it, and the hosts' packets to the gateway would be answered
through the other bridge and never arrive.
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


def _ip_out(*args: str) -> str:
    return subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=20
    ).stdout


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
        # 10.213.X.0/24, X first tried from the pid and a serial, so concurrent sessions
        # and several networks of one session mostly start apart; `__enter__` moves on
        # from any name or subnet already taken.
        self._first_subnet = 16 + (pid * 7 + serial) % 200
        self._first_tag = f"{_PREFIX}{pid % 100000}{chr(ord('a') + serial % 26)}"
        self.subnet = -1
        self.tag = self.bridge = self.gateway = ""
        self.workdir = workdir
        self.hosts: list[Host] = []
        self._made_bridge = False

    def __enter__(self) -> Network:
        try:
            self._claim_bridge()
            _ip("link", "set", self.bridge, "up")  # the kernel routes an up device's subnet
            self._claim_subnet()
        except BaseException:
            self.close()
            raise
        return self

    def _claim_bridge(self) -> None:
        """Make the bridge under the first free tag: `ip link add` is the atomic claim,
        and the tag must also name no namespace (a leaked one outlives its bridge)."""
        namespaces = _ip_out("netns", "list")
        for attempt in range(26):
            tag = self._first_tag if attempt == 0 else f"{self._first_tag}{chr(97 + attempt)}"
            if f"{tag}h" in namespaces:
                continue
            try:
                _ip("link", "add", f"{tag}br", "type", "bridge")
            except subprocess.CalledProcessError:
                continue  # the name exists: a leaked or concurrent session's
            self.tag, self.bridge, self._made_bridge = tag, f"{tag}br", True
            return
        raise RuntimeError(f"no free bridge name from {self._first_tag}; `ip link` lists them")

    def _claim_subnet(self) -> None:
        """Put the gateway on the first 10.213.X.0/24 no address or route here uses, then
        check that no other device took it meanwhile (a concurrent session)."""
        for step in range(256):
            subnet = (self._first_subnet + step) % 256
            prefix = f"10.213.{subnet}."
            if prefix in _ip_out("-4", "addr", "show") or prefix in _ip_out("-4", "route"):
                continue
            _ip("addr", "add", f"{prefix}254/24", "dev", self.bridge)
            routes = _ip_out("-4", "route", "show", f"{prefix}0/24").splitlines()
            if len(routes) == 1 and f"dev {self.bridge} " in f"{routes[0]} ":
                self.subnet, self.gateway = subnet, f"{prefix}254"
                return
            _ip("addr", "del", f"{prefix}254/24", "dev", self.bridge)
        raise RuntimeError("every 10.213.X.0/24 subnet is in use here; `ip -4 route` lists them")

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
