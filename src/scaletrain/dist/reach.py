"""Before a process joins a multi-node job: can it reach rank 0, and over which interface?

torch's store client retries a name that does not resolve, or a master that does
not answer, for the whole process-group timeout (30 minutes by default), silently;
the watchdog starts only after init. These checks take seconds and say which
variable is wrong. They run in every rank that torch would otherwise leave waiting.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from typing import Any

from scaletrain.env.base import ClusterEnv
from scaletrain.env.network import (
    choose_interface,
    is_local,
    listen_socket,
    loopback_address,
    port_in_use,
    resolve,
    wait_connectable,
)
from scaletrain.errors import EnvironmentDetectionError, LaunchError

__all__ = ["MASTER_WAIT_S", "check_master", "gloo_interface", "join_store", "serve_store"]

MASTER_WAIT_S = 300.0
"""How long a rank waits for rank 0's store to listen (rank 0 may still be importing
torch on a loaded node); an unreachable address fails within seconds instead."""


def _where(env: ClusterEnv) -> str:
    """Where the master address came from, in the reader's own words."""
    for reason in env.reasons:
        if "MASTER_ADDR" in reason or "rank 0 runs on" in reason or "master" in reason:
            return reason
    return f"the {env.kind} environment"


def _fix(env: ClusterEnv) -> str:
    if env.kind == "slurm":
        return (
            "make the node names resolve on every node (DNS or /etc/hosts), or export "
            f"MASTER_ADDR=<address of {env.master_addr}> before srun (Slurm's own address "
            f"for it: `scontrol show node {env.master_addr}`, field NodeAddr)"
        )
    if env.kind == "mpi":
        from scaletrain.env.mpi import mpirun_command

        return (
            f"pass rank 0's address instead: {mpirun_command()} -x MASTER_ADDR=<IP of rank "
            "0's host>"
        )
    return "set MASTER_ADDR to an address of rank 0's host that every node resolves (an IP works)"


def check_master(env: ClusterEnv, *, wait_s: float = MASTER_WAIT_S) -> None:
    """Raise EnvironmentDetectionError (one paragraph) if this rank cannot reach rank 0.

    Every rank resolves the master's name. Rank 0, where it opens the store itself,
    checks that the port is free; the others wait until the store accepts
    connections. Under torchrun the agent's store is up before any worker starts.
    """
    host, port = env.master_addr, env.master_port
    here = socket.gethostname()
    try:
        addresses = resolve(host)
    except OSError as exc:
        raise EnvironmentDetectionError(
            f"The master host {host!r} (from {_where(env)}) does not resolve on this node "
            f"({here}, rank {env.rank}): {exc}. Every rank connects to rank 0's store at "
            f"{host}:{port}, and torch would retry this name until its timeout, silently. "
            f"Expected a name or address of rank 0's host that every node resolves. Fix: "
            f"{_fix(env)}."
        ) from None
    if env.rank == 0:
        # Rank 0 opens the store itself, or torchrun's agent already has (its own port,
        # or one it found free for the workers): nothing to wait for.
        if env.kind == "torchelastic":
            return
        if is_local(addresses) and port_in_use(port):
            raise EnvironmentDetectionError(
                f"Port {port} on this node ({here}) is already in use, but rank 0 must open "
                f"the job's store there ({host}:{port}, {_where(env)}). Another job on this "
                f"host holds it. Fix: give each job its own port (export MASTER_PORT=<free "
                f"port> for every rank), or stop the other job."
            )
        return
    ok, problem = wait_connectable(host, port, wait_s)
    if not ok:
        raise EnvironmentDetectionError(
            f"Rank {env.rank} on {here} cannot reach rank 0's store at {host}:{port} "
            f"({', '.join(addresses)}; from {_where(env)}): {problem}. Expected rank 0 to "
            f"listen there (it opens the store as it starts). Fix: check that rank 0 started "
            f"and did not fail (its output says), that {host} is rank 0's host as seen from "
            f"this node, and that no firewall blocks TCP port {port}; or {_fix(env)}."
        )


def serve_store(address: str, port: int, *, timeout_s: float, **options: Any) -> Any:
    """A TCPStore server that listens on `address` only (port 0: a free port).

    torch's TCPStore takes no address to bind and listens on every interface: an
    unauthenticated key-value store that anyone on the network can read and write.
    It does serve a socket it is given (`master_listen_fd`), which is how a store
    reached at a loopback address stays on loopback. `options` are TCPStore's
    (world_size, wait_for_workers, multi_tenant). Raises OSError where the port is
    taken.
    """
    import torch
    import torch.distributed as dist

    # torch's libuv server serves a given socket from 2.8 on (before, it never
    # accepted on it); its classic server always has.
    libuv = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
    sock = listen_socket(address, port)
    try:
        store = dist.TCPStore(
            host_name=address,
            port=sock.getsockname()[1],
            is_master=True,
            timeout=_dt.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
            use_libuv=libuv,
            **options,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now, and closes it
    return store


def join_store(env: ClusterEnv, timeout_s: float) -> Any:
    """The job's store, joined by every rank within MASTER_WAIT_S, then patient for `timeout_s`.

    What env:// does (a TCPStore on rank 0, multi-tenant, that waits for every rank),
    except that rank 0 waits for the others only MASTER_WAIT_S, not the process
    group's whole timeout: a rank that failed before joining (a name it could not
    resolve, a crash at import) leaves rank 0 waiting, and srun without
    --kill-on-bad-exit does not end it.
    """
    import torch.distributed as dist

    join = min(timeout_s, MASTER_WAIT_S)
    # Every rank on this machine: the store listens on loopback, not on every interface.
    local = loopback_address(env.master_addr) if env.rank == 0 else None
    try:
        if local is not None:
            store = serve_store(
                local, env.master_port, timeout_s=join, world_size=env.world_size,
                wait_for_workers=True, multi_tenant=True,
            )  # fmt: skip
        else:
            store = dist.TCPStore(
                host_name=env.master_addr,
                port=env.master_port,
                world_size=env.world_size,
                is_master=env.rank == 0,
                timeout=_dt.timedelta(seconds=join),
                wait_for_workers=True,
                multi_tenant=True,
            )
    except (OSError, RuntimeError, dist.DistError) as exc:
        who = "rank 0 (this process)" if env.rank == 0 else f"rank {env.rank}"
        raise LaunchError(
            f"The job's ranks did not all join the store at {env.master_addr}:{env.master_port} "
            f"within {join:g}s ({who} on {socket.gethostname()}): {exc}. Expected all "
            f"{env.world_size} ranks to start and connect. Fix: look for the first rank that "
            f"failed in the job's output (this is a consequence); if they all started, check "
            f"that every node reaches {env.master_addr}:{env.master_port}."
        ) from None
    store.set_timeout(_dt.timedelta(seconds=timeout_s))
    return store


def gloo_interface(env: ClusterEnv) -> tuple[str, str] | None:
    """(interface, why) for GLOO_SOCKET_IFNAME where the user set none; None: leave it.

    One node: loopback, since every peer is local (and the host's own address may be
    one peers cannot use, in containers and VPNs). Several nodes: the interface that
    routes to the other nodes (see scaletrain.env.network), never the one the host
    name happens to resolve to.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if env.num_nodes == 1:
        return "lo", "every rank runs on this node"
    peers = [h for h in env.hosts if h != env.master_addr]
    choice = choose_interface(env.master_addr, peers)
    if choice is None:
        return None
    return choice.name, f"{choice.address}: {choice.why}"
