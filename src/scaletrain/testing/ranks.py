"""Start N processes with the variables torchrun gives its workers, run a function, collect results.

Each rank runs with OMP_NUM_THREADS=1 (two ranks x two threads on two cores is
several times slower than one thread each), Gloo bound to loopback, and a fresh
free port, so tests can run side by side.

The ranks are forked from multiprocessing's forkserver, a clean process (no thread,
nothing run) that has imported torch once: a rank then starts in a fraction of a
second instead of the seconds each import of torch costs, which in a suite of
multi-process tests is most of their time. Each rank is still a process of its own,
with the caller's environment as it is at the call, writing to the caller's standard
output and error. Where there is no forkserver (Windows), they are spawned.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RankFailure", "free_port", "launcher_free_env", "launcher_variables", "run_ranks"]

# What launchers and schedulers set: a test that starts its own job must not inherit
# them (a CI runner inside SLURM, a shell left with MASTER_PORT set...).
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "SM_", "TORCHELASTIC_", "PET_")
_LAUNCHER_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
)  # fmt: skip


def launcher_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Names in `environ` (default: os.environ) that some launcher or scheduler set."""
    env = os.environ if environ is None else environ
    return [k for k in env if k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_NAMES]


def launcher_free_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment as a fresh shell would start a job: no launcher or
    scheduler variables, one thread per process (OMP_NUM_THREADS=1)."""
    env = dict(os.environ if environ is None else environ)
    for name in launcher_variables(env):
        del env[name]
    env["OMP_NUM_THREADS"] = "1"
    return env


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message has each rank's story."""


_PRELOAD = ["torch", "torch._dynamo"]
"""What the forkserver imports before it forks any rank: torch, and the compiler stack
that the first optimizer (or DDP, or FSDP) imports on its first use."""


class _CallerOutput:
    """The caller's standard output and error (file descriptors 1 and 2, wherever they
    point at the call: a terminal, a file, pytest's capture), handed to a rank as it
    starts. A spawned rank inherits them; a forked one has the forkserver's, which are
    its first caller's."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank's process starts: the start method passes the two
        # descriptors along, and the rank receives its own copies of them.
        from multiprocessing import reduction

        return (_received_output, (reduction.DupFd(1), reduction.DupFd(2)))


def _received_output(out: Any, err: Any) -> tuple[int, int]:
    return out.detach(), err.detach()


def _start_method() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the forkserver starts (the first call); the same list every time.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    """A TCP port nobody listens on right now (bound to 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    output: tuple[int, int] | None,
) -> None:
    if output is not None:
        for fd, standard in zip(output, (1, 2), strict=True):
            if fd != standard:
                os.dup2(fd, standard)
                os.close(fd)
    # The caller's whole environment, as a spawned process would inherit it: a forked
    # one inherits the forkserver's, which is the environment of its first caller.
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as given, not as the forkserver found it
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(*args, **kwargs)
        # Serialised here: tensors put on a Queue are shared through file descriptors
        # that vanish when this process exits before the parent has read them.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    nproc_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the values by rank.

    `fn` must be importable by name (a module-level function): each rank imports it.
    `nproc_per_node` splits the ranks into nodes (same host) to exercise node ranks.
    """
    import torch

    per_node = nproc_per_node or world_size
    port = free_port()
    ctx = _start_method()
    output = _CallerOutput() if ctx.get_start_method() == "forkserver" else None
    results = ctx.Queue()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(world_size // per_node),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "TORCHELASTIC_RUN_ID": f"scaletrain-test-{port}",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        p = ctx.Process(
            target=_child, args=(fn, rank, rank_env, args, kwargs, results, output), daemon=True
        )
        p.start()
        procs.append(p)
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(values) - set(errors))
                errors.update({r: f"timed out after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in values and r not in errors:
                        # Give a just-exited rank's queued result a moment to arrive.
                        time.sleep(0.5)
                        if results.empty():
                            errors[r] = f"process died with exit code {p.exitcode}"
                continue
            if ok:
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
            if not ok:
                # One failure usually strands the peers in a collective: stop waiting soon.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        story = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} rank(s) failed:\n{story}")
    return [values[r] for r in range(world_size)]
