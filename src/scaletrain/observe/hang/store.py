"""The key-value store the ranks' watchdogs meet in: its keys, a client, the answers.

Only the watchdog's own thread touches it, never through a collective: the training
thread may be stuck inside one, and a second thread entering the same process group
would deadlock or corrupt it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time

import torch.distributed as dist

from scaletrain.observe.hang.heartbeat import Heartbeat

__all__ = [
    "LEADER_KEY",
    "REPORTED_KEY",
    "REQUEST_KEY",
    "STORE_PREFIX",
    "STORE_TIMEOUT_S",
    "connect_store",
    "gather_answers",
    "read_heartbeats",
]

STORE_PREFIX = "scaletrain/watchdog"  # PrefixStore adds the "/"
LEADER_KEY = "leader"
REQUEST_KEY = "request"
REPORTED_KEY = "reported"
STORE_TIMEOUT_S = 10.0


def connect_store(
    prefix: str, given: dist.Store | None, *, world_size: int, timeout_s: float
) -> dist.Store | None:
    """`given` under `prefix`, else a TCPStore client of our own to MASTER_ADDR:MASTER_PORT
    (None alone, or where those are unset)."""
    if given is not None:
        return dist.PrefixStore(prefix, given)
    if world_size == 1:
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    # A client of our own: a store object is not shared with the process group's
    # threads, and a hung collective cannot hold it.
    client = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        # Bounds connecting and every call; short enough that an unreachable store
        # cannot keep the thread from its local check for long.
        timeout=_dt.timedelta(seconds=min(STORE_TIMEOUT_S, max(1.0, timeout_s / 2))),
        wait_for_workers=False,
    )
    return dist.PrefixStore(prefix, client)


def read_heartbeats(store: dist.Store, world_size: int) -> dict[int, Heartbeat]:
    """Every rank's last published heartbeat (ranks that never published are absent)."""
    keys = [f"hb/{r}" for r in range(world_size)]
    found: dict[int, Heartbeat] = {}
    if store.check(keys):
        values = store.multi_get(keys)
        pairs = list(zip(range(world_size), values, strict=True))
    else:
        pairs = [(r, store.get(k)) for r, k in enumerate(keys) if store.check([k])]
    for r, value in pairs:
        with contextlib.suppress(ValueError, TypeError):
            found[r] = Heartbeat.from_json(value)
    return found


def gather_answers(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    pause: float,
    answer_by: float,
    traces_by: float,
) -> tuple[dict[int, Heartbeat], set[int]]:
    """Wait for every rank's stacks (until `answer_by`: the ones that answered are
    alive) and their traces (until `traces_by`); return heartbeats and who answered."""
    every = range(world_size)
    responsive = {rank}
    with contextlib.suppress(Exception):
        for prefix, deadline in (("ack", answer_by), ("done", traces_by)):
            while True:
                wanted = [f"{prefix}/{r}" for r in every if r in responsive or prefix == "ack"]
                if store.check(wanted):
                    if prefix == "ack":
                        responsive = set(every)
                    break
                if prefix == "ack":
                    responsive |= {r for r in every if store.check([f"ack/{r}"])}
                if time.monotonic() >= deadline:
                    break
                time.sleep(pause)
    heartbeats: dict[int, Heartbeat] = {}
    with contextlib.suppress(Exception):
        heartbeats = read_heartbeats(store, world_size)
    return heartbeats, responsive
