"""Checks before anything is spawned: the script exists, the rendezvous endpoint works.

Each turns a usual setup mistake into one paragraph (LaunchError) instead of a
traceback from deep inside torch after the other nodes started waiting.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scaletrain.env.network import port_in_use
from scaletrain.errors import LaunchError

if TYPE_CHECKING:
    from scaletrain.launch.config import LaunchConfig
    from scaletrain.launch.plan import Plan

__all__ = ["check_network", "check_target", "is_rendezvous_store"]

_PROG = "scaletrain launch"
_POLL_INTERVAL_S = 0.25


def check_target(script: str, run_as_module: bool) -> None:
    if run_as_module:
        # Workers run `python -m SCRIPT` from this directory, which puts the current
        # directory first on sys.path; look the module up the same way.
        saved = list(sys.path)
        sys.path.insert(0, os.getcwd())
        try:
            spec = importlib.util.find_spec(script)
            reason = "" if spec is not None else "it is not on the Python path"
        except (ImportError, ValueError) as exc:
            spec, reason = None, str(exc)
        finally:
            sys.path[:] = saved
        if spec is None:
            raise LaunchError(
                f"Cannot launch module {script!r} (-m): {reason}. Expected an importable "
                f"module name such as 'mypkg.train', found from {os.getcwd()} or PYTHONPATH. "
                f"Fix: check the spelling, run from the directory that holds the package or "
                f"install it (pip install -e .), or drop -m to run a script file."
            )
        return
    path = os.path.abspath(script)
    runnable = os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py"))
    if not runnable:
        what = "is a directory without __main__.py" if os.path.isdir(path) else "does not exist"
        raise LaunchError(
            f"Cannot launch {script!r}: {path} {what}. Expected the path of a Python training "
            f"script (relative to {os.getcwd()}) followed by its arguments. Fix: check the path; "
            f"to run an installed module instead, pass -m and its dotted name."
        )


def _resolve(host: str, port: int, source: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"The rendezvous host {host!r} (from {source}) does not resolve to an address: "
            f"{exc}. Expected node 0's hostname or IP address as this machine sees it. "
            f"Fix: check the spelling, use node 0's IP address, or fix DNS or /etc/hosts on "
            f"this node."
        ) from None
    return [str(info[4][0]) for info in infos]


def _is_local(addresses: Sequence[str]) -> bool:
    for address in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
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


def _wait_reachable(plan: Plan, timeout_s: float) -> None:
    assert plan.host is not None and plan.port is not None
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(
                (plan.host, plan.port), timeout=max(0.1, min(2.0, remaining))
            ):
                return
        except OSError as exc:
            last_error = exc.strerror or type(exc).__name__
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if not announced:
            print(
                f"{_PROG}: waiting up to {timeout_s:g}s for the rendezvous store at "
                f"{plan.host}:{plan.port} (node 0) to come up...",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        time.sleep(min(_POLL_INTERVAL_S, remaining))
    who = f"node rank {plan.node_rank}" if plan.node_rank is not None else "this node"
    raise LaunchError(
        f"Cannot reach the rendezvous store at {plan.host}:{plan.port} (from "
        f"{plan.endpoint_source}) after {timeout_s:g}s: {last_error}. This is {who}; it "
        f"connects to the store that node 0 opens there. Check that node 0 has been started "
        f"with the same endpoint and --node-rank 0, that {plan.host} is node 0's address as "
        f"seen from this machine, and that no firewall blocks TCP port {plan.port}; if node 0 "
        f"starts later, raise --rdzv-timeout."
    )


def check_network(plan: Plan, cfg: LaunchConfig) -> None:
    if plan.host is None or plan.port is None:
        return  # standalone: torch picks a free local port itself
    addresses = _resolve(plan.host, plan.port, plan.endpoint_source)
    hosts_store = plan.hosts_store
    if hosts_store is None and _is_local(addresses):
        # Node rank unknown and the endpoint is this machine: torch's own heuristic
        # hosts the store if the port is free and joins it otherwise. A taken port may
        # be another agent of this job on the same host, so it is not an error here.
        return
    if hosts_store:
        # Checked only where this node is certain to host the store (node rank 0 or
        # the only node): torch would otherwise fail with "address already in use"
        # deep in a traceback, after the other nodes have started waiting.
        if port_in_use(plan.port):
            raise LaunchError(
                f"Port {plan.port} on this machine is already in use, but this node "
                f"(node rank {plan.node_rank if plan.node_rank is not None else 0}) must host "
                f"the rendezvous store on {plan.host}:{plan.port} (from "
                f"{plan.endpoint_source}). Another job, or an earlier launch still running, "
                f"holds it. Fix: stop that process (find it with `ss -ltnp 'sport = "
                f":{plan.port}'`), or pick a free port and pass it in --rdzv-endpoint on "
                f"every node."
            )
        return
    _wait_reachable(plan, cfg.rdzv_timeout)
    _check_is_store(plan, cfg.rdzv_timeout)


# c10d TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a
# client first sends VALIDATE (query 0) with this magic number, then PING (query 13)
# with a nonce, which the store echoes. Both the libuv and the classic server do so in
# torch 2.13; tests/launcher checks it against a real TCPStore, so a torch that
# changes the protocol fails a test here rather than a user's launch.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


def is_rendezvous_store(host: str, port: int, timeout_s: float) -> str | None:
    """None if a c10d store answers at host:port within `timeout_s`, else what happened.

    Plain sockets, not torch's client: torch's waits past its own timeout when the
    peer accepts the connection and never answers, which is what a port held by
    another service does.
    """
    nonce = os.getpid() & 0xFFFFFFFF
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<BI", _PING, nonce))
            reply = b""
            while len(reply) < 4:
                chunk = conn.recv(4 - len(reply))
                if not chunk:
                    return "it closed the connection"
                reply += chunk
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if struct.unpack("<I", reply)[0] != nonce:
        return f"it answered {reply!r}, not a store's reply"
    return None


def _check_is_store(plan: Plan, timeout_s: float) -> None:
    """Something answers at the endpoint: make sure it is a rendezvous store.

    A port held by another service (a web server, an old job's worker) accepts the
    TCP connection, and torch's store client then waits for an answer that never
    comes, past --rdzv-timeout. A store answers a ping at once.
    """
    assert plan.host is not None and plan.port is not None
    wait = max(1.0, min(10.0, timeout_s))
    problem = is_rendezvous_store(plan.host, plan.port, wait)
    if problem is None:
        return
    raise LaunchError(
        f"Something listens at the rendezvous endpoint {plan.host}:{plan.port} (from "
        f"{plan.endpoint_source}), but it is not a rendezvous store: {problem}. Another "
        f"service holds that port. Fix: check that {plan.host}:{plan.port} is node 0's "
        f"launcher (started with --node-rank 0 and the same --rdzv-endpoint), or pick a "
        f"free port and pass it in --rdzv-endpoint on every node."
    )
