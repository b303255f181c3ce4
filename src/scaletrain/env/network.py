"""Where this machine sits on the network: names, addresses, interfaces, reachability.

Three multi-node failures are network facts that can be checked in a second
before anything waits: the master's name does not resolve here (torch's store
client then retries for the whole 30-minute timeout), the master does not answer
(same), and Gloo binds the wrong interface. Gloo, without GLOO_SOCKET_IFNAME,
binds the address this host's name resolves to; Debian's /etc/hosts maps the
host's own name to 127.0.1.1, so each rank tells its peers to connect to a
loopback address they cannot reach, and the job hangs in connectFullMesh. The
right interface is the one that routes to the peers, which the kernel will say
(a UDP socket "connected" to an address sends nothing, but gets the source
address the routing table picks).

Plain sockets only: no torch, so the launcher can check before it imports it.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "InterfaceChoice",
    "choose_interface",
    "interface_addresses",
    "interface_of",
    "is_local",
    "listen_socket",
    "loopback_address",
    "node_range",
    "port_in_use",
    "resolve",
    "route_source",
    "split_endpoint",
    "wait_connectable",
]

_SIOCGIFADDR = 0x8915
_MAX_PORT = 65535


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """ "HOST:PORT" (or "[IPv6]:PORT") -> (host, port); ValueError saying what is wrong."""
    text = endpoint.strip()
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("a bare IPv6 address is ambiguous with its port: write [ADDR]:PORT")
    if not sep or not host:
        raise ValueError("it is not HOST:PORT")
    if not port_text.isdigit() or not 0 < int(port_text) <= _MAX_PORT:
        raise ValueError(f"the port must be a number in 1..{_MAX_PORT}")
    return host, int(port_text)


def node_range(nnodes: str) -> tuple[int, int]:
    """ "N" or "MIN:MAX" -> (min_nodes, max_nodes); ValueError saying what is wrong."""
    parts = str(nnodes).strip().split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError('it is neither a node count "N" nor a range "MIN:MAX"')
    lo, hi = int(parts[0]), int(parts[-1])
    if not 0 < lo <= hi:
        raise ValueError(f"it gives min_nodes={lo}, max_nodes={hi}; expected 1 <= MIN <= MAX")
    return lo, hi


_ROUTE_PROBE_PORT = 9  # "discard"; nothing is ever sent to it


def resolve(host: str) -> list[str]:
    """The IPv4/IPv6 addresses `host` resolves to here; raises OSError (socket.gaierror)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except UnicodeError as exc:
        raise socket.gaierror(str(exc)) from None
    seen: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in seen:
            seen.append(addr)
    return seen


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local(addresses: Iterable[str]) -> bool:
    """True if any of `addresses` belongs to this machine (loopback included)."""
    for address in addresses:
        if _is_loopback(address):
            return True
        # Binding succeeds only to an address of one of this machine's interfaces.
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def loopback_address(host: str) -> str | None:
    """The address to listen on for a server reached at `host`, where `host` is written
    as this machine's loopback: "localhost" or a loopback IP (127.0.0.1, ::1); None for
    any other host.

    A name that merely resolves to loopback here is not: Debian maps the host's own
    name to 127.0.1.1, while the other nodes reach that name at its real address.
    For "localhost", the first address it resolves to: the one a client tries first.
    """
    if host == "localhost":
        try:
            addresses = resolve(host)
        except OSError:
            return None
        return addresses[0] if addresses and all(_is_loopback(a) for a in addresses) else None
    return host if _is_loopback(host) else None


def listen_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to `address` only (port 0: a free one) and listening.

    torch's TCPStore binds every interface of the machine unless it is given a socket
    to listen on (`master_listen_fd`): this is that socket. SO_REUSEADDR as torch's
    own store sets it, so a port in TIME_WAIT from the last run is free. Raises
    OSError where the address is not this machine's or the port is taken.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # down or no IPv4 address
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to reach `address`; None if no route."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, _ROUTE_PROBE_PORT))
        except OSError:
            return None
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, or None."""
    for name, addr in interface_addresses().items():
        if addr == address:
            return name
    return None


class InterfaceChoice(NamedTuple):
    """The interface to bind for traffic between nodes, and why it was picked."""

    name: str
    address: str
    why: str


def choose_interface(master: str, peers: Sequence[str] = ()) -> InterfaceChoice | None:
    """The interface this host should use to talk to the other nodes of a job.

    `master` is the host of rank 0, `peers` other nodes' hosts where they are known
    (Slurm's node list). The route to the first of them that is not this machine
    decides; on the master itself, whose route to its own name is loopback, a peer
    decides, else the default route, else the only non-loopback interface. None
    where nothing sensible is found (the caller then leaves the choice to Gloo).
    """
    for host in (master, *peers):
        try:
            addresses = resolve(host)
        except OSError:
            continue
        ipv4 = [a for a in addresses if ":" not in a]
        for address in ipv4:
            if is_local([address]):
                continue  # our own name: its route says nothing about the peers
            source = route_source(address)
            name = interface_of(source) if source else None
            if name and source and not _is_loopback(source):
                return InterfaceChoice(name, source, f"it routes to {host} ({address})")
    # This host is the master and no peer is known: the default route, as the
    # peers most likely reach us through it.
    source = route_source("192.0.2.1")  # TEST-NET-1: only the routing table is asked
    name = interface_of(source) if source else None
    if name and source and not _is_loopback(source):
        return InterfaceChoice(name, source, "it holds the default route")
    others = {n: a for n, a in interface_addresses().items() if not _is_loopback(a)}
    if len(others) == 1:
        name, address = next(iter(others.items()))
        return InterfaceChoice(name, address, "it is the only interface besides loopback")
    return None


def port_in_use(port: int) -> bool:
    """True if something on this machine listens on TCP `port` (any address)."""
    # SO_REUSEADDR as torch's store does: a port in TIME_WAIT from the last run is free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def wait_connectable(
    host: str, port: int, timeout_s: float, *, unreachable_s: float = 10.0, poll_s: float = 0.25
) -> tuple[bool, str]:
    """Try to open a TCP connection to host:port; (True, "") once one succeeds.

    A refused connection means the host is up and nothing listens yet (rank 0 still
    importing torch): that is retried for `timeout_s`. No route, an unreachable host
    or connection attempts that time out (a firewall dropping them) are retried for
    `unreachable_s` only, so a wrong address fails in seconds. Returns (False, the
    last error in words) when the time is up.
    """
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return True, ""
        except TimeoutError:
            refused, last = False, "connection attempts time out (a firewall, or a wrong address)"
        except OSError as exc:
            refused = exc.errno == errno.ECONNREFUSED
            if refused:
                last = "connection refused: the host answers but nothing listens on that port"
            else:
                last = exc.strerror or type(exc).__name__
        elapsed = time.monotonic() - start
        if elapsed >= (timeout_s if refused else min(timeout_s, unreachable_s)):
            return False, last
        time.sleep(poll_s)
