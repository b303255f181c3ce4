"""Collectives for metrics and coordination, cheap at world size 1.

They run on scaletrain's own CPU (Gloo) group over every rank (`control_group`), which
only scaletrain holds: rt.shutdown destroys it, so its worker threads are joined while
Python is whole. A Gloo worker lets go of a collective's tensors after the waiting
thread has gone on; letting go of a tensor made in Python takes the GIL, and a thread
that asks for the GIL while the interpreter finalizes is ended by pthread_exit, whose
unwinding through the work's destructor aborts the process ("terminate called without
an active exception"). The default group may outlive rt.shutdown (a DDP model the
loop still holds keeps it), so it is left to the collectives DDP runs itself, and to
`gather_rows` under NCCL, whose rows stay on the GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import pickle
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError, PeerFailure, article

__all__ = [
    "REDUCE_OPS",
    "PendingFlag",
    "all_gather_floats",
    "any_rank",
    "any_rank_async",
    "barrier",
    "broadcast_object",
    "control_group",
    "from_rank_zero",
    "gather_rows",
    "rank_first",
    "reduce_values",
    "release_control_group",
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
    values: Mapping[str, Number],
    op: str = "sum",
    *,
    device: torch.device | None = None,
    checked: bool = True,
) -> dict[str, Any]:
    """Reduce every value across ranks in ONE collective.

    Values are packed into a single float64 vector (exact for counts below 2**53), in
    the order of their names, so reducing a dict of metrics costs one all-reduce, not
    one per key. Tensors come back as tensors of their own dtype and device, numbers as
    numbers: an int as an int where the result is whole (a float from another rank can
    make it not). Every rank must pass the same names, each with as many elements: one
    tiny collective on scaletrain's CPU group checks that first (`_same_values`), as a
    mismatch would add unrelated values or hang the collective, and a rank whose values
    are refused here has every rank raise. `checked=False` skips it, for a dict whose
    names and sizes the code fixes (a value refused on one rank then leaves the others
    waiting for it).
    """
    problem: ConfigError | None = None
    shapes: list[tuple[str, torch.Size, torch.dtype | None, torch.device | None]] = []
    flat: list[torch.Tensor] = []
    try:
        items = _items(values, op)
    except ConfigError as exc:
        problem, items = exc, []
    for key, value in items:
        if isinstance(value, torch.Tensor):
            t = value.detach()
            shapes.append((key, t.shape, t.dtype, t.device))
            flat.append(t.reshape(-1).to(torch.float64).cpu() if device is None else t.reshape(-1))
        else:
            shapes.append((key, torch.Size([]), None, None))
            flat.append(torch.tensor([float(value)], dtype=torch.float64))
    if checked and _active():
        _same_values([(key, shape.numel()) for key, shape, _, _ in shapes], problem)
    if problem is not None:
        raise problem
    if not values:
        return {}
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
    reduced: dict[str, Any] = {}
    offset = 0
    for key, shape, dtype, dev in shapes:
        n = shape.numel()
        chunk = buf[offset : offset + n]
        offset += n
        if dtype is None:
            number = float(chunk.item())
            is_int = isinstance(values[key], int) and op != "mean" and number.is_integer()
            reduced[key] = round(number) if is_int else number
        else:
            # A copy: a view would keep `buf`, which the collective had, alive in the caller.
            reduced[key] = chunk.reshape(shape).to(device=dev, dtype=dtype, copy=True)
    return {key: reduced[key] for key in values}


def _items(values: Any, op: str) -> list[tuple[str, Any]]:
    """The values to reduce in packing order (by name), each a tensor or a number."""
    if op not in REDUCE_OPS:
        raise ConfigError(f"op={op!r} is not a reduction; expected one of {', '.join(REDUCE_OPS)}.")
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"rt.reduce({values!r}): expected a dict of name -> tensor or number, reduced in "
            "one collective. Fix: name the value, e.g. rt.reduce({'loss': loss})['loss'], or "
            "pass every value of the step at once: rt.reduce({'loss': loss, 'count': n})."
        )
    for key, value in values.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number or isinstance(value, torch.Tensor)):
            raise ConfigError(
                f"reduce() got {key}={value!r} of type {type(value).__name__}; expected tensors "
                "or numbers (int/float). Convert it, e.g. torch.tensor(x)."
            )
    return sorted(values.items(), key=lambda kv: str(kv[0]))


def _same_values(layout: list[tuple[str, int]], problem: ConfigError | None) -> None:
    """Raise on every rank where the ranks' names and sizes (`layout`, in packing order)
    differ, or where one of them was called wrongly (`problem`: it raises its own): one
    all-reduce (MAX) of this rank's count of elements and a checksum of its layout,
    beside their negatives (whose MAX is the smallest), and a failure flag."""
    said = ", ".join(f"{k!r}" + (f" ({n} elements)" if n != 1 else "") for k, n in layout)
    size = sum(n for _, n in layout)
    check = zlib.crc32(repr(layout).encode())
    failed = 1.0 if problem is not None else 0.0
    t = torch.tensor([size, check, -size, -check, failed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    if problem is not None:
        return  # this rank raises its own
    if t[4] > 0:
        raise PeerFailure(
            "rt.reduce: another rank was called wrongly (it raises why); this one's values "
            "were not reduced."
        )
    if t[0] != -t[2] or t[1] != -t[3]:
        raise ConfigError(
            "rt.reduce: the ranks passed different names or sizes to reduce (this rank: "
            f"{said or 'nothing'}); the values are reduced name by name in one collective, "
            "so every rank passes the same names, each value with as many elements. Fix: "
            "give every rank every name, with 0 (or zeros) where a rank has nothing to add."
        )


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


_TIMEOUT: list[datetime.timedelta] = []
"""The job's collective timeout, as `init_process_group` set the default group's
(`st.init(timeout=...)`); empty where scaletrain did not make that group."""


def set_collective_timeout(timeout: datetime.timedelta) -> None:
    """The timeout of the groups scaletrain makes beside the default one (`gloo_group`)."""
    _TIMEOUT[:] = [timeout]


def gloo_group() -> Any:
    """A new Gloo group over every rank (a collective), with the job's timeout: torch's
    new_group gives a group its backend's default (30 minutes), not the default group's,
    so a peer missing from one of scaletrain's collectives would hang that long."""
    return dist.new_group(backend="gloo", timeout=_TIMEOUT[0] if _TIMEOUT else None)


def control_group() -> Any:
    """scaletrain's CPU (Gloo) group over every rank, made once per default process group
    (a collective: every rank makes it at the same point, at its first use).

    Its own group also under Gloo, not the default one: only scaletrain holds it, so
    `release_control_group` (rt.shutdown) ends it and joins its threads."""
    global _CONTROL
    world = dist.group.WORLD
    if _CONTROL[0] is not world:
        _CONTROL = (world, gloo_group())
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


def gather_rows(
    tensors: list[torch.Tensor],
    *,
    world_size: int,
    device: torch.device | None = None,
    name: str,
    problem: str | None = None,
) -> list[torch.Tensor]:
    """Each of `tensors` from every rank, concatenated along dim 0 in rank order (a 0-d
    tensor is one row). First dimensions may differ between ranks; the other sizes and
    the dtype may not.

    Every rank's shapes and dtypes go first, in one gather on the CPU group, with
    `problem`: this rank's own error in the call (`name`) found before, if any. So a
    mistake on one rank raises on every rank, ConfigError where it was made and
    PeerFailure on the others, instead of leaving them waiting in a collective. The rows
    then travel as bytes, padded to the longest rank's: on `device` through the default
    group (a GPU under NCCL), else on the CPU group. Results are on each tensor's device.
    """
    rows = [t.detach().reshape(1) if t.dim() == 0 else t.detach() for t in tensors]
    if world_size == 1 or not _active():
        if problem is not None:
            raise ConfigError(problem)
        return rows
    group = control_group()
    mine = (problem, [(tuple(r.shape), str(r.dtype)) for r in rows])
    meta: list[Any] = [None] * world_size
    dist.all_gather_object(meta, mine, group=group)
    if problem is not None:
        raise ConfigError(problem)
    failed = [r for r, (other, _) in enumerate(meta) if other is not None]
    if failed:
        raise PeerFailure(f"{name}: rank {failed[0]} was called wrongly; its error says how")
    kinds = [[(shape[1:], dtype) for shape, dtype in m[1]] for m in meta]
    if any(k != kinds[0] for k in kinds):
        seen = "; ".join(
            f"rank {r}: "
            + (", ".join(f"{list(shape)} {dtype.replace('torch.', '')}" for shape, dtype in m[1])
               or "nothing")
            for r, m in enumerate(meta)
        )  # fmt: skip
        raise ConfigError(
            f"{name}: the ranks' tensors differ beyond their first dimension ({seen}); "
            "expected as many tensors on every rank, each with the same dtype and the same "
            "sizes after dim 0, which are concatenated along dim 0. Fix: give every rank "
            "tensors of the same kind (an empty one, torch.empty(0, ...), where a rank has "
            "no rows)."
        )
    return [
        _gather_one(r, [int(m[1][i][0][0]) for m in meta], device, group)
        for i, r in enumerate(rows)
    ]


def _gather_one(
    rows: torch.Tensor, counts: list[int], device: torch.device | None, group: Any
) -> torch.Tensor:
    # As bytes: every dtype travels (Gloo lacks some, e.g. bool), the same way on both.
    width = math.prod(rows.shape[1:])
    flat = rows.reshape(rows.shape[0], width).contiguous().view(torch.uint8)
    comm = device if device is not None else torch.device("cpu")
    padded = torch.zeros(max(counts), flat.shape[1], dtype=torch.uint8, device=comm)
    padded[: rows.shape[0]] = flat.to(comm)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=None if device is not None else group)
    joined = torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])
    out = joined.view(rows.dtype).reshape(sum(counts), *rows.shape[1:])
    return out.to(rows.device)


def broadcast_object(obj: Any, src: int, *, world_size: int, name: str) -> Any:
    """Rank `src`'s `obj` on every rank (pickled; `src` keeps its own object).

    Pickled on `src` before anything is sent: an object that cannot be pickled raises
    ConfigError there and PeerFailure on the others, instead of leaving them waiting in
    the broadcast. On scaletrain's CPU group: no GPU involved.
    """
    if world_size == 1 or not _active():
        return obj
    group = control_group()
    mine = dist.get_rank() == src
    data, problem = b"", ""
    if mine:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # pickling raises TypeError, AttributeError, PicklingError...
            problem = f"{type(exc).__name__}: {exc}"
    size = torch.tensor([-1 if problem else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if int(size.item()) < 0:
        if mine:
            raise ConfigError(
                f"{name}: the object on rank {src}, {article(type(obj).__name__)}, cannot be "
                f"pickled ({problem}); expected plain data (numbers, strings, lists, dicts, "
                "tensors on the CPU). Fix: broadcast what it is made from instead."
            )
        raise PeerFailure(f"{name}: rank {src} could not send its object; its error says why")
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if mine
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=group)
    return obj if mine else pickle.loads(buf.numpy().tobytes())
