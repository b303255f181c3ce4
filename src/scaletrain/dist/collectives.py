"""Collectives for metrics and coordination, cheap at world size 1.

They run on scaletrain's own CPU (Gloo) group over every rank (`control_group`), which
only scaletrain holds: rt.shutdown destroys it, so its worker threads are joined while
Python is whole. A Gloo worker lets go of a collective's tensors after the waiting
thread has gone on; letting go of a tensor made in Python takes the GIL, and a thread
that asks for the GIL while the interpreter finalizes is ended by pthread_exit, whose
unwinding through the work's destructor aborts the process ("terminate called without
an active exception"). The default group may outlive rt.shutdown (a DDP model the
loop still holds keeps it), so it is left to the collectives DDP runs itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError, PeerFailure

__all__ = [
    "REDUCE_OPS",
    "control_group",
    "release_control_group",
    "PendingFlag",
    "all_gather_floats",
    "any_rank",
    "any_rank_async",
    "barrier",
    "from_rank_zero",
    "rank_first",
    "reduce_values",
]

REDUCE_OPS = ("sum", "mean", "max", "min")

Number = torch.Tensor | float | int


# (the default process group it was made beside, scaletrain's Gloo group)
_CONTROL: tuple[Any, Any] = (None, None)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(device: torch.device | None = None) -> None:
    if not _active():
        return
    if device is not None and device.type == "cuda" and dist.get_backend() == "nccl":
        # Without device_ids NCCL guesses the device and warns; pass ours.
        dist.barrier(device_ids=[device.index or 0])
    else:
        dist.barrier()


def from_rank_zero(text: str) -> str:
    """Rank 0's `text` on every rank (one broadcast); `text` itself at world size 1.

    For a choice one process must make for all: a name stamped from rank 0's clock,
    where each rank reading its own could straddle a second.
    """
    if not _active():
        return text
    box: list[Any] = [text]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return str(box[0])


def reduce_values(
    values: Mapping[str, Number], op: str = "sum", *, device: torch.device | None = None
) -> dict[str, Any]:
    """Reduce every value across ranks in ONE collective.

    Values are packed into a single float64 vector (exact for counts below 2**53),
    so reducing a dict of metrics costs one all-reduce, not one per key. Tensors
    come back as tensors of their own dtype and device, numbers as numbers.
    """
    if op not in REDUCE_OPS:
        raise ConfigError(f"op={op!r} is not a reduction; expected one of {', '.join(REDUCE_OPS)}.")
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"rt.reduce({values!r}): expected a dict of name -> tensor or number, reduced in "
            "one collective. Fix: name the value, e.g. rt.reduce({'loss': loss})['loss'], or "
            "pass every value of the step at once: rt.reduce({'loss': loss, 'count': n})."
        )
    if not values:
        return {}
    shapes: list[tuple[str, torch.Size, torch.dtype | None, torch.device | None]] = []
    flat: list[torch.Tensor] = []
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            t = value.detach()
            shapes.append((key, t.shape, t.dtype, t.device))
            flat.append(t.reshape(-1).to(torch.float64).cpu() if device is None else t.reshape(-1))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            shapes.append((key, torch.Size([]), None, None))
            flat.append(torch.tensor([float(value)], dtype=torch.float64))
        else:
            raise ConfigError(
                f"reduce() got {key}={value!r} of type {type(value).__name__}; expected tensors "
                "or numbers (int/float). Convert it, e.g. torch.tensor(x)."
            )
    comm_device = device if device is not None else torch.device("cpu")
    buf = torch.cat([f.to(device=comm_device, dtype=torch.float64) for f in flat])
    if _active():
        dist_op = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,  # Gloo has no AVG: sum, then divide below.
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        # Values on the CPU go through scaletrain's Gloo group (no GPU synchronisation);
        # values on a GPU through the default (NCCL) group.
        group = control_group() if buf.device.type == "cpu" else None
        dist.all_reduce(buf, op=dist_op, group=group)
        if op == "mean":
            buf /= dist.get_world_size()
    out: dict[str, Any] = {}
    offset = 0
    for key, shape, dtype, dev in shapes:
        n = shape.numel()
        chunk = buf[offset : offset + n]
        offset += n
        if dtype is None:
            number = chunk.item()
            original = values[key]
            is_int = isinstance(original, int) and op != "mean"
            out[key] = round(number) if is_int else float(number)
        else:
            # A copy: a view would keep `buf`, which the collective had, alive in the caller.
            out[key] = chunk.reshape(shape).to(device=dev, dtype=dtype, copy=True)
    return out


@contextlib.contextmanager
def rank_first(is_first: bool) -> Iterator[None]:
    """The `is_first` ranks run the body, then the others do.

    One all-reduce of a failure flag stands in for the usual barrier, so if a first
    rank fails (a download, a corrupted file), the waiting ranks raise at once
    instead of hanging until the collective timeout.
    """
    if not _active():
        yield
        return
    flag = torch.zeros(1)
    group = control_group()
    if not is_first:
        dist.all_reduce(flag, group=group)
        if flag.item() > 0:
            raise PeerFailure(
                "the first rank of this node failed inside rank_zero_first(); see its error above"
            )
        yield
        return
    try:
        yield
    except BaseException:
        flag += 1
        dist.all_reduce(flag, group=group)
        raise
    dist.all_reduce(flag, group=group)
    if flag.item() > 0:
        raise PeerFailure("another node's first rank failed inside rank_zero_first()")


def control_group() -> Any:
    """scaletrain's CPU (Gloo) group over every rank, made once per default process group
    (a collective: every rank makes it at the same point, at its first use).

    Its own group also under Gloo, not the default one: only scaletrain holds it, so
    `release_control_group` (rt.shutdown) ends it and joins its threads."""
    global _CONTROL
    world = dist.group.WORLD
    if _CONTROL[0] is not world:
        _CONTROL = (world, dist.new_group(backend="gloo"))
    return _CONTROL[1]


def release_control_group() -> None:
    """Drop scaletrain's hold on its Gloo group (and on the default group it was made
    beside); the last reference gone, torch's destructor joins the group's threads."""
    global _CONTROL
    _CONTROL = (None, None)


def any_rank(flag: bool, *, world_size: int) -> bool:
    """True on every rank if `flag` is True on any: one tiny collective.

    Runs on scaletrain's CPU (Gloo) group even under NCCL, so checking it every step
    costs no GPU synchronisation.
    """
    if world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return bool(t.item() > 0)


class PendingFlag:
    """An `any_rank_async` in flight: `result()` waits for it and gives the same answer on
    every rank (the MAX of every rank's flag)."""

    __slots__ = ("_around", "_tensor", "_work")

    def __init__(
        self,
        work: Any,
        tensor: torch.Tensor,
        around: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self._work, self._tensor, self._around = work, tensor, around

    def result(self) -> bool:
        if self._work is not None:
            with self._around() if self._around is not None else contextlib.nullcontext():
                self._work.wait()
            self._work = None
        return bool(self._tensor.item() > 0)


def any_rank_async(
    flag: bool,
    *,
    world_size: int,
    around: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> PendingFlag:
    """`any_rank` without waiting: the all-reduce runs on the CPU (Gloo) group's own
    threads while the caller goes on; `.result()` collects it (wrapped in `around()`, the
    ledger's phase, if given). Every rank must call it at the same point of its program,
    as for any collective."""
    t = torch.tensor([1.0 if flag else 0.0])
    if world_size == 1:
        return PendingFlag(None, t)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group(), async_op=True)
    return PendingFlag(work, t, around)


def all_gather_floats(values: list[float], *, world_size: int) -> list[list[float]]:
    """Every rank's `values` (same length everywhere), by rank: one all-gather on the CPU
    (Gloo) group, so it never synchronises a GPU (the step ledger's window gather)."""
    if world_size == 1 or not _active():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=control_group())
    return [r.tolist() for r in rows]
