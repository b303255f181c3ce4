"""The rendezvous the launcher's agents meet in: torch's own, with three rules added.

torch's c10d and static rendezvous are used as they are, each wrapped in a handler
registered through torch's public registry of rendezvous backends. The torchrun
command a plan shows (`--dry-run`) names torch's backend; `agent_rendezvous` names
the wrapped one in the settings the launcher gives torch's agent. What the wrapper adds:

- **Node ranks.** torch's c10d rendezvous numbers the nodes by sorting their
  addresses (then process ids) and ignores `--node-rank`, so the node started with
  `--node-rank 0` could hold ranks 4-7, and rank 0's logs and files land on another
  machine. After each round the nodes tell each other their `--node-rank` through the
  round's store and take their places in that order; nodes without one come after,
  in torch's order. The static rendezvous numbers the nodes by their rank already.
- **The end.** A node whose store went away cannot tell its own workers' failure from
  node 0 leaving: it stops its workers and reports the store gone, not their error.
  Every node says through the store when it has ended (its workers' result read, or
  the rendezvous closed under it), and the node that hosts the store keeps it until
  all of the last round's nodes have, at most `ENDED_WAIT_S`: on success (after
  torch's exit barrier) and on failure alike.
- **Loopback.** torch's TCPStore listens on every interface, unauthenticated. Where
  the endpoint is a loopback address (one node: torchrun's `--standalone` becomes a
  c10d rendezvous at 127.0.0.1), the rendezvous store and the store torch shares
  with the workers listen on loopback only (see scaletrain.dist.reach.serve_store).
  Across nodes they must be reachable from the other nodes and stay on every
  interface: the README says what that exposes.
- **Rounds.** Each handler counts the rounds its agent entered and the ones that
  formed (`Rounds`), so that the launcher tells a rendezvous that never formed from
  one that failed after the workers ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
    )

    from scaletrain.launch.plan import Plan

__all__ = ["ENDED_WAIT_S", "LOOPBACK", "Rounds", "agent_rendezvous", "counted", "register"]

ENDED_WAIT_S = 15.0
"""How long the node that hosts the store waits for the others to end. Nodes whose
workers fail for one cause (a refusal after a gather, a peer gone) end within seconds
of each other; a node whose workers still run is not waited for longer."""

LOOPBACK = "127.0.0.1"

_C10D, _STATIC = "scaletrain-c10d", "scaletrain-static"
_NODE_RANK = "scaletrain_node_rank"
_RANK_KEY = "scaletrain/node-rank/"
_ENDED_KEY = "scaletrain/nodes-ended"
_POLL_S = 0.05
_STORE_TIMEOUT_S = 300.0
"""TCPStore's own default timeout, for the store shared with the workers."""


@dataclasses.dataclass(slots=True)
class Rounds:
    """The rendezvous rounds of one launch, as its handler saw them."""

    entered: int = 0
    """Rounds the agent asked to join (a second one follows a worker failure or a node
    leaving)."""
    formed: int = 0
    """Rounds that formed, after each of which the agent started its workers."""


_ROUNDS: dict[str, Rounds] = {}


@contextlib.contextmanager
def counted(run_id: str) -> Iterator[Rounds]:
    """Count the rounds of the rendezvous `run_id` (the launch's --rdzv-id) while it runs."""
    rounds = _ROUNDS[run_id] = Rounds()
    try:
        yield rounds
    finally:
        _ROUNDS.pop(run_id, None)


@functools.cache
def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class NodeRendezvous(RendezvousHandler):
        """torch's handler `inner`, with the node order and the end described above."""

        def __init__(self, backend: str, inner: RendezvousHandler, node_rank: int | None,
                     order: bool, hosts: bool | None) -> None:  # fmt: skip
            self._rounds = _ROUNDS.get(inner.get_run_id(), Rounds())
            self._backend = backend
            self._inner = inner
            self._node_rank = node_rank
            self._order = order
            self._hosts = hosts
            self._last: RendezvousInfo | None = None

        def get_backend(self) -> str:
            return self._backend  # torch's registry checks it is the name asked for

        @property
        def use_agent_store(self) -> bool:
            return bool(self._inner.use_agent_store)

        def next_rendezvous(self) -> RendezvousInfo:
            self._rounds.entered += 1
            info = self._inner.next_rendezvous()
            if self._order and info.world_size > 1:
                info = _by_node_rank(info, self._node_rank)
            self._last = info
            self._rounds.formed += 1
            return info

        def is_closed(self) -> bool:
            return self._inner.is_closed()

        def set_closed(self) -> None:
            self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self._inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self._inner.get_run_id()

        def shutdown(self) -> bool:
            # torch calls this once on every node at the end (not when a signal ended
            # the agent). Closing first lets a node waiting for a next round end.
            try:
                return self._inner.shutdown()
            finally:
                if self._last is not None and self._last.world_size > 1:
                    _ended(self._last, wait=self._hosts is not False)

    return NodeRendezvous


def _by_node_rank(info: RendezvousInfo, node_rank: int | None) -> RendezvousInfo:
    """`info` with this node's rank taken from the order of the nodes' --node-rank."""
    from torch.distributed.elastic.rendezvous import RendezvousInfo

    store, size = info.store, info.world_size
    store.set(f"{_RANK_KEY}{info.rank}", str(-1 if node_rank is None else node_rank))
    given = [int(v) for v in store.multi_get([f"{_RANK_KEY}{r}" for r in range(size)])]
    # Ranked nodes first, by rank; then the others. torch's order breaks ties, so every
    # node computes the same permutation.
    order = sorted(range(size), key=lambda r: (given[r] < 0, given[r], r))
    bootstrap: Any = info.bootstrap_store_info  # where the workers' store is: unchanged
    return RendezvousInfo(store, order.index(info.rank), size, bootstrap)


def _ended(info: RendezvousInfo, *, wait: bool) -> None:
    """Say this node has ended; where `wait`, keep this process (and the store it holds)
    until every node of the round has, at most ENDED_WAIT_S. A store already gone
    (its node ended first) ends the wait at once."""
    with contextlib.suppress(Exception):
        ended = info.store.add(_ENDED_KEY, 1)
        deadline = time.monotonic() + ENDED_WAIT_S
        while wait and ended < info.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            ended = info.store.add(_ENDED_KEY, 0)


def _create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
        create_backend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from scaletrain.dist.reach import serve_store
    from scaletrain.env.network import loopback_address

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    hosts = params.get_as_bool("is_host")
    local = loopback_address(host)
    store: Any = None
    if local is not None:
        if params.local_addr is None or loopback_address(params.local_addr) is None:
            params.local_addr = local  # what the workers are told to connect to
        if hosts is not False:
            timeout = params.get_as_int("read_timeout", 60) or 60
            try:
                store = serve_store(local, port, timeout_s=timeout, multi_tenant=True)
                hosts = True
            except OSError as exc:
                if hosts:
                    raise RendezvousConnectionError(
                        f"The rendezvous store cannot listen on {local}:{port}: {exc}"
                    ) from exc
                # As torch's own guess: another agent on this machine hosts it.
                hosts = False
    if store is None:
        backend, store = create_backend(params)
    else:
        backend = C10dRendezvousBackend(store, params.run_id)
    inner: Any = create_handler(store, backend, params)
    shared_at = loopback_address(params.local_addr) if params.local_addr else None
    if shared_at is not None:
        from scaletrain.launch.compat import serve_shared_store

        # The store torch shares with the workers (rank 0's node opens it): torch binds
        # every interface; this one listens where the workers are told to connect.
        def shared_store(master_addr: str, master_port: int) -> Any:
            return serve_store(shared_at, master_port, timeout_s=_STORE_TIMEOUT_S,
                               multi_tenant=True)  # fmt: skip

        serve_shared_store(inner, shared_store)
    node_rank = params.get_as_int(_NODE_RANK)
    handler: RendezvousHandler = _handler_class()(_C10D, inner, node_rank, True, hosts)
    return handler


def _create_static(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    # torchrun passes the rank as a number; from --rdzv-conf it comes as text.
    node_rank = int(params.config["rank"])
    params.config["rank"] = node_rank
    inner = create_rdzv_handler(params)
    handler: RendezvousHandler = _handler_class()(_STATIC, inner, node_rank, False, node_rank == 0)
    return handler


def register() -> None:
    """Register the wrapped backends with torch (again: a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_C10D, _create_c10d)
    rendezvous_handler_registry.register(_STATIC, _create_static)


def agent_rendezvous(plan: Plan) -> dict[str, Any]:
    """The rendezvous part of torch's LaunchConfig for `plan`: its nodes, the wrapped
    backend, endpoint, job id and options (see the module doc).

    One node (`standalone`) is what torchrun makes of --standalone (a c10d rendezvous
    on a free port, a fresh id), at 127.0.0.1 rather than on every interface. The
    static backend's node rank and endpoint, which torchrun fills in only for a
    backend named "static", are filled in here.
    """
    from scaletrain.launch.config import parse_nnodes

    register()
    min_nodes, max_nodes = parse_nnodes(plan.nnodes)
    configs: dict[str, Any] = dict(plan.rdzv_conf)
    settings: dict[str, Any] = {"min_nodes": min_nodes, "max_nodes": max_nodes}
    if plan.mode == "standalone":
        configs["is_host"] = "true"
        settings.update(rdzv_backend=_C10D, rdzv_endpoint=f"{LOOPBACK}:0",
                        run_id=str(uuid.uuid4()), local_addr=plan.local_addr or LOOPBACK)  # fmt: skip
    elif plan.mode == "c10d":
        backend = plan.rdzv_backend or "c10d"
        if backend == "c10d":
            backend = _C10D
            if plan.node_rank is not None:
                configs[_NODE_RANK] = plan.node_rank
        # Another backend a platform names (etcd) is torch's own, as it is.
        settings.update(rdzv_backend=backend, rdzv_endpoint=plan.rdzv_endpoint,
                        run_id=plan.rdzv_id, local_addr=plan.local_addr)  # fmt: skip
    elif plan.mode == "static":
        configs["rank"] = plan.node_rank
        host = f"[{plan.host}]" if plan.host and ":" in plan.host else plan.host
        settings.update(rdzv_backend=_STATIC, rdzv_endpoint=f"{host}:{plan.port}",
                        run_id=plan.rdzv_id, local_addr=plan.local_addr)  # fmt: skip
    else:
        raise ValueError(f"a {plan.mode} plan has no rendezvous of its own")
    settings["rdzv_configs"] = configs
    return settings
