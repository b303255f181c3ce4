"""Creating and tearing down the default process group."""

from __future__ import annotations

import datetime as _dt
import gc
import ipaddress
import os

import torch
import torch.distributed as dist

from scaletrain.dist.collectives import release_control_group, set_collective_timeout
from scaletrain.dist.reach import check_master, gloo_interface, join_store
from scaletrain.env.base import ClusterEnv
from scaletrain.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "claim_first", "destroy", "init_process_group", "is_initialized"]

DEFAULT_TIMEOUT_S = 1800.0


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _export_env(env: ClusterEnv) -> None:
    # env:// is the one init method that also works under torchrun, whose agent
    # shares its own TCPStore with the workers through these same variables.
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)


def init_process_group(
    env: ClusterEnv,
    *,
    backend: str,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the job described by `env`. A no-op at world size 1: no store, no threads."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ConfigError(
            f"timeout={timeout_s!r}: expected seconds, a positive number. Fix: e.g. "
            "timeout=600 for ten minutes."
        )
    if env.world_size == 1:
        return
    set_collective_timeout(_dt.timedelta(seconds=timeout_s))
    if is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ConfigError(
                "a process group already exists with rank "
                f"{dist.get_rank()}/{dist.get_world_size()}, but the environment says rank "
                f"{env.rank}/{env.world_size}. Call scaletrain.init() once per process, or call "
                "rt.shutdown() before initialising again."
            )
        return
    _export_env(env)
    if env.num_nodes > 1 or not _is_loopback(env.master_addr):
        # Seconds instead of torch's silent retries until `timeout_s`.
        check_master(env)
    if backend == "gloo":
        choice = gloo_interface(env)
        if choice is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = choice[0]
    kwargs: dict[str, object] = {}
    if backend == "nccl" and device.type == "cuda":
        # Binding the group to this rank's GPU makes NCCL create its communicator
        # eagerly on the right device instead of guessing from the current device.
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store and every rank has joined it already.
        kwargs["init_method"] = "env://"
    else:
        kwargs["store"] = join_store(env, timeout_s)
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )


def claim_first(key: str) -> bool:
    """True on the first rank of the job to claim `key`, False on the others.

    One compare-and-set in the job's key-value store, no collective (the caller may be
    failing while its peers are inside one). Used to print a failure once: the first
    rank that failed reports it, the ranks that failed because of it stay quiet.
    Without a process group every caller is first; where the store is gone (its host,
    rank 0's process, already ended) rank 0 is.
    """
    if not is_initialized():
        return True
    rank = dist.get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
        got = store.compare_set(f"scaletrain/first/{key}", "", str(rank))
        return bytes(got).decode() == str(rank)
    except Exception:
        return rank == 0


def destroy(*, failed: bool = False) -> None:
    """Tear down in the order that keeps Gloo from aborting at interpreter exit.

    A Gloo worker thread lets go of a finished collective's tensors after the thread
    that waited for it has gone on, and letting go of a tensor made in Python takes the
    GIL. A thread that asks for the GIL while the interpreter finalizes is ended with
    pthread_exit, whose unwinding through the work's destructor aborts the process
    ("terminate called without an active exception", after the run's last output). So
    the groups are destroyed here, which joins their threads while Python is whole:
    scaletrain's own Gloo group (dist/collectives.py) always, the default group when
    nothing else holds it (garbage is collected first: the models the caller dropped).
    A DDP model the caller still holds keeps the default group to the process's end;
    its threads then hold nothing of Python's: DDP's buckets are also its reducer's,
    and rt.shutdown waits until they have freed the ledger's bucket callbacks.

    After a failure (`failed`) a peer may be gone in the middle of a collective, and
    joining a group's threads would wait for that collective's timeout: scaletrain's
    group is then left to the end of the process.
    """
    if not is_initialized():
        return
    gc.collect()
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
        if not failed:
            release_control_group()  # its last reference: torch joins its threads here
    gc.collect()
