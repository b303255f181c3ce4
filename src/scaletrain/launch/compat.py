"""The only places the launcher reaches into torch's private code, each because torch
offers no public way to do it. Checked against torch 2.13.0 (`CHECKED`).

Everything else goes through torch's public API: a `LaunchConfig` given to
`elastic_launch`, rendezvous handlers registered in torch's registry. What is left:

- **Starting the workers** (`LocalElasticAgent._start_workers`, wrapped for one
  launch by `watch_workers`). torch starts the workers inside the agent, with no hook
  around it, and keeps them in a private attribute (`_pcontext`). The launcher needs
  three things from that moment: the workers must start with Ctrl-C held (a Ctrl-C
  forwarded while a worker's interpreter starts prints a KeyboardInterrupt traceback
  from the middle of an import; see guard.py), their pids (a second Ctrl-C kills them,
  and `scaletrain train` removes the pid files of workers killed so), and how they
  ended when a signal stopped the agent (`exit_codes`: all 75 means every worker saved
  before it stopped, and the launcher exits 75, "preempted, start again"). torch
  reports none of this once a signal ends its agent.
- **The store the agent shares with the workers**
  (`DynamicRendezvousHandler._create_tcp_store_server`, replaced on one handler by
  `serve_shared_store`). torch's TCPStore listens on every interface and takes no
  address to bind; where the rendezvous is on loopback, this store must be too.

Where a torch version lacks a patched method, the launcher goes on without it (the
Ctrl-C and exit-code details above are lost, nothing else). tests/launcher/
test_compat.py fails on any torch whose patched methods are not the ones recorded in
`CHECKED`: check the wrapper still fits the new code, then record it
(`fingerprint`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "CHECKED",
    "exit_codes",
    "fingerprint",
    "patched",
    "serve_shared_store",
    "watch_workers",
]

CHECKED: dict[str, dict[str, tuple[str, str]]] = {
    "2.13.0": {
        "LocalElasticAgent._start_workers": (
            "(self, worker_group: 'WorkerGroup') -> 'dict[int, Any]'",
            "3a15b68937f57e63",
        ),
        "DynamicRendezvousHandler._create_tcp_store_server": (
            "(self, master_addr, master_port) -> torch._C._distributed_c10d.TCPStore",
            "05894ebe3d332def",
        ),
        # Read, not patched: where exit_codes finds each worker's process.
        "SubprocessContext._start": ("(self)", "13f8a20c922df6b4"),
    },
}
"""torch version -> what each private member it uses looked like when checked:
(signature, the first 16 hex digits of the SHA-256 of its source)."""


def patched() -> dict[str, Any]:
    """The private members of torch named in CHECKED, as the installed torch has them
    (a missing one is left out)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    owners = {
        "LocalElasticAgent": LocalElasticAgent,
        "DynamicRendezvousHandler": DynamicRendezvousHandler,
        "SubprocessContext": SubprocessContext,
    }
    names = {name for recorded in CHECKED.values() for name in recorded}
    found = {}
    for name in sorted(names):
        owner, _, attribute = name.partition(".")
        member = getattr(owners[owner], attribute, None)
        if member is not None:
            found[name] = member
    return found


def fingerprint(member: Any) -> tuple[str, str]:
    """(signature, SHA-256 of the source, first 16 hex digits) of a function."""
    source = inspect.getsource(member)
    return str(inspect.signature(member)), hashlib.sha256(source.encode()).hexdigest()[:16]


@contextlib.contextmanager
def watch_workers(
    on_start: Callable[[list[int], Any], None], *, hold: Callable[[], Any]
) -> Iterator[None]:
    """For the duration of one launch: torch's agent starts its workers inside `hold()`
    (a context manager: SIGINT blocked), and `on_start(pids, workers)` hears of each
    start, with the agent's process context (for `exit_codes`)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    start_workers = getattr(LocalElasticAgent, "_start_workers", None)
    if start_workers is None:
        yield
        return

    def started(self: Any, worker_group: Any) -> Any:
        with hold():
            pids = start_workers(self, worker_group)
            on_start(list(pids.values()), getattr(self, "_pcontext", None))
        return pids

    LocalElasticAgent._start_workers = started  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._start_workers = start_workers  # type: ignore[method-assign]


def exit_codes(workers: Any) -> list[int | None]:
    """How each worker of a process context ended (None: still running)."""
    handlers = getattr(workers, "subprocess_handlers", None) or {}
    return [getattr(handler.proc, "returncode", None) for handler in handlers.values()]


def serve_shared_store(handler: Any, serve: Callable[[str, int], Any]) -> None:
    """Have torch's c10d rendezvous `handler` open the store it shares with the workers
    through `serve(address, port)` instead of a TCPStore on every interface."""
    if hasattr(handler, "_create_tcp_store_server"):
        handler._create_tcp_store_server = serve
