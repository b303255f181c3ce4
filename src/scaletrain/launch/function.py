"""`st.launch(fn, nproc=N, args=...)`: run a Python function on N processes of this node.

For code that is already running Python: a notebook, a test, a script that builds its
model before it starts the ranks. PyTorch's elastic launcher (`elastic_launch`, its
public API, which takes a function as its entry point) starts and watches the
processes; what `scaletrain launch` gives its workers, they get too:

- the launcher's variables (`launch_environment`: OMP_NUM_THREADS=1 where it sets it,
  Gloo on loopback) and unbuffered output (`python -u`, for a script);
- scaletrain's rendezvous on 127.0.0.1 and a free port (rendezvous.py), so two
  launches on one machine never collide and no store listens on the network;
- the orphan rule (guard.py): a rank dies with this process.

Each rank runs `fn(*args)`, which may call `st.init()`. What comes back is every
rank's return value in rank order; a failure is one `RankError` naming the rank that
failed first, with its exception and traceback, not one report per rank. The ranks
are started with multiprocessing's spawn, which imports the function by name: it must
be defined at a module's top level, and a lambda or a local function is refused before
anything starts.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from scaletrain.errors import ConfigError, LaunchError, RankError, ScaletrainError
from scaletrain.exitcodes import EXIT_ABORTED, EXIT_ERROR, EXIT_USAGE
from scaletrain.launch.config import DEFAULT_RDZV_TIMEOUT_S, LaunchConfig
from scaletrain.launch.failures import (
    _exit_code,
    _why_unrecorded,
    cause_of,
    is_consequence,
    record_failure,
)
from scaletrain.launch.interrupts import _child_pids, _Interrupts, _quiet_agent
from scaletrain.launch.launcher import AGENT_SIGNALS, _launch_environ, agent_config
from scaletrain.launch.plan import Plan, _default_nproc_per_node
from scaletrain.launch.rendezvous import LOOPBACK

__all__ = ["launch_function"]

_PROG = "st.launch"
_SIGNALS = tuple(AGENT_SIGNALS.split(","))
"""What torch's agent handles by forwarding it to the ranks (as `scaletrain launch`);
Ctrl-C is handled here instead (_Interrupts: once asks the ranks, twice kills them)."""
_SPAWNED = b"--multiprocessing-fork"
"""On the command line of every process multiprocessing's spawn starts."""
_QUIET = ("torch.distributed.elastic", "torch.multiprocessing")
_EXCEPTION = "exception"
"""The record's key for the pickled exception (base64), where it pickles."""
_CAUSE_GRACE_S = 5.0
"""How long a rank that failed only because a peer went away waits for that peer to
end first (_await_the_cause)."""


# --- before anything starts ------------------------------------------------------------


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickle_error(obj: object) -> Exception | None:
    """Why spawn could not send `obj` to a process (None: it can), found without copying
    tensors or moving them to shared memory: they always pickle, so they are skipped."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    class Probe(ForkingPickler):
        def persistent_id(self, o: object) -> object:
            return 1 if isinstance(o, (torch.Tensor, torch.UntypedStorage)) else None

    try:
        Probe(_Sink(), pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        return exc
    return None


_AT_TOP_LEVEL = (
    "Fix: define it with `def` at the top level of a .py file and import it (a module's "
    "function is sent by name, as multiprocessing's spawn requires); pass what it needs "
    "through args=(...)."
)


def _check_function(fn: object) -> None:
    if not callable(fn):
        raise ConfigError(
            f"st.launch(fn=...) received {fn!r} ({type(fn).__name__}), which is not callable. "
            f"Expected the function each rank runs. Fix: st.launch(train, nproc=2, "
            f"args=(...)) with `def train(...)` at a module's top level.",
            field="fn",
        )
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    what = f"{name!r}" if name else repr(fn)
    if getattr(fn, "__name__", None) == "<lambda>":
        raise ConfigError(
            f"st.launch(fn=...) received a lambda ({fn!r}): each rank is a new process that "
            f"must import the function by name, and a lambda has none. {_AT_TOP_LEVEL}",
            field="fn",
        )
    if isinstance(name, str) and "<locals>" in name:
        raise ConfigError(
            f"st.launch(fn=...) received {what}, a function defined inside another function: "
            f"each rank is a new process that must import the function by name, and a local "
            f"function cannot be imported. {_AT_TOP_LEVEL}",
            field="fn",
        )
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ConfigError(
            f"st.launch(fn=...) received {what}, defined in an interactive session (a "
            f"notebook, the REPL or `python -c`): each rank is a new process that imports "
            f"the function from its file, and this session has no file to import. "
            f"{_AT_TOP_LEVEL}",
            field="fn",
        )
    error = _pickle_error(fn)
    if error is not None:
        raise ConfigError(
            f"st.launch(fn=...) received {what}, which cannot be sent to the ranks "
            f"({type(error).__name__}: {error}). Expected a function each new process can "
            f"import by name. {_AT_TOP_LEVEL}",
            field="fn",
        )


def _check_args(args: object) -> tuple[Any, ...]:
    if not isinstance(args, (tuple, list)):
        raise ConfigError(
            f"st.launch(args=...) received {args!r} ({type(args).__name__}), not a tuple of "
            f"arguments. Expected the positional arguments of fn, as a tuple or a list. "
            f"Fix: args=(value,) for one argument (the comma makes it a tuple).",
            field="args",
        )
    for i, value in enumerate(args):
        error = _pickle_error(value)
        if error is not None:
            raise ConfigError(
                f"st.launch(args=...): args[{i}] ({type(value).__name__}) cannot be sent to "
                f"the ranks ({type(error).__name__}: {error}). Expected values that pickle: "
                f"tensors, models, numbers, module-level functions and classes. Fix: pass "
                f"what builds it (a path, a config) and build it inside fn.",
                field="args",
            )
    return tuple(args)


def _check_call(fn: Callable[..., Any], name: str, args: tuple[Any, ...]) -> None:
    """`fn(*args)` binds: a missing or extra argument is refused before any process
    starts, not by every rank after (a function without a signature is let through)."""
    try:  # the function's own, not what a decorator wraps (it may supply arguments)
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise ConfigError(
            f"st.launch({name}, args={args!r}): {name}({', '.join(signature.parameters)}) "
            "cannot be called with "
            f"them ({exc}). Fix: args=(...) with a value for each of its parameters "
            "(args=(value,) for one).",
            field="args",
        ) from None


def _check_nproc(nproc: object) -> int:
    if nproc is None:
        return _default_nproc_per_node()
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(
            f"st.launch(nproc={nproc!r}) is not a process count. Expected an integer >= 1 "
            f"(usually the number of GPUs). Fix: pass e.g. nproc=2, or leave it out for one "
            f"process per GPU (2 without one).",
            field="nproc",
        )
    return nproc


# --- in each rank ----------------------------------------------------------------------


def _die_with(agent: int) -> None:
    """SIGKILL this rank when the launching process dies (see guard.py), and stop at
    once where it has died already."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != agent:
            sys.exit("scaletrain: the launching process ended before this rank started")


def _record(exc: BaseException, code: int) -> None:
    """This rank's failure for the launching process, with the exception itself where it
    pickles (the launching process rebuilds it for RankError.exception)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _rank_main.__code__ and tb.tb_next is not None:
        exc = exc.with_traceback(tb.tb_next)  # the traceback starts in fn, not here
    extra: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        extra[_EXCEPTION] = base64.b64encode(pickle.dumps(exc)).decode("ascii")
    rank = int(os.environ.get("RANK", "0"))
    usage = isinstance(exc, ScaletrainError)
    record_failure(exc, rank=rank, usage=usage, exit_code=code, extra=extra)


def _await_the_cause() -> None:
    """This rank failed because another went away. The agent reports the ranks that
    have ended when it first sees one fail, and stops the others (SIGTERM) before they
    record anything: the rank that caused it, still recording its error (a `with
    st.init()` block shuts its process group down first, which is what this rank
    saw), would go unreported. Waiting lets it end first; the agent's SIGTERM then
    ends the wait, and a wait that nothing ends is bounded."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # fn's handler, if any, has had its turn
    time.sleep(_CAUSE_GRACE_S)


def _rank_main(agent: int, fn: Callable[..., Any], *args: Any) -> bytes:
    """What each rank runs: `fn(*args)`; its return value serialised (torch.save: tensors
    as data, not as shared memory that ends with this process); a failure recorded."""
    _die_with(agent)
    # A session of its own, as `scaletrain launch`'s workers have (torch starts those
    # so): a terminal's Ctrl-C reaches the launching process alone, which passes it on
    # once (_Interrupts); reaching the ranks too, the second copy read as a second Ctrl-C.
    with contextlib.suppress(OSError):
        os.setsid()
    try:
        value = fn(*args)
        buffer = io.BytesIO()
        try:
            import torch

            torch.save(value, buffer)
        except Exception as exc:
            raise ConfigError(
                f"{getattr(fn, '__qualname__', 'fn')} returned {type(value).__name__}, which "
                f"cannot be sent back to st.launch's caller ({type(exc).__name__}: {exc}). "
                f"Expected a value that pickles. Fix: return tensors, numbers, strings, "
                f"lists and dicts of them (a model's state_dict(), not the model that "
                f"holds a process group)."
            ) from None
        return buffer.getvalue()
    except KeyboardInterrupt:
        # Ctrl-C (from the terminal or forwarded by the agent): end quietly; the
        # launching process says so once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(EXIT_ABORTED)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise  # torch's record() makes it a rank that returned None
        _record(exc, exc.code if isinstance(exc.code, int) else EXIT_ERROR)
        raise
    except Exception as exc:
        code = EXIT_USAGE if isinstance(exc, ScaletrainError) else EXIT_ERROR
        _record(exc, code)
        if is_consequence(exc):
            _await_the_cause()
        sys.exit(code)  # not the exception: torch's record() would write its own file


# --- the launching process -------------------------------------------------------------


def _spawned_children() -> set[int]:
    """This process's children that multiprocessing's spawn started (Linux; else none)."""
    found = set()
    for pid in _child_pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if _SPAWNED in f.read().split(b"\0"):
                found.add(pid)
    return found


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """Put back every handler torch's agent and _Interrupts replace: the caller (a
    notebook's kernel) keeps its own Ctrl-C and SIGTERM handling after the launch."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", *_SIGNALS)
    saved = {s: signal.getsignal(s) for n in names if (s := getattr(signal, n, None)) is not None}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rebuilt(record: dict[str, Any]) -> BaseException | None:
    data = record.get(_EXCEPTION)
    if not isinstance(data, str):
        return None
    try:
        value = pickle.loads(base64.b64decode(data))
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None


def _rank_error(failures: dict[int, Any], nproc: int, fn_name: str) -> RankError:
    rank, record = cause_of(failures)
    failure = failures[rank]
    code, how = _exit_code(failure)
    others = sorted(r for r in failures if r != rank)
    also = (
        f" Rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed after it."
        if others
        else ""
    )
    if record is None:
        if int(failure.exitcode) >= 0:
            why = (
                "it ended before or outside fn: the process could not import fn or its "
                "arguments (where fn is in the script you ran, its top level must be under "
                '`if __name__ == "__main__":`, since every rank imports that file), or fn '
                "called os._exit"
            )
        else:
            why = _why_unrecorded(int(failure.exitcode))
        return RankError(
            f"{_PROG}: rank {rank} of {nproc} (pid {failure.pid}) {how} without raising an "
            f"exception in {fn_name}: {why}. Its own output above says more.{also}",
            rank=rank,
            exit_code=code,
        )
    kind, text = str(record.get("type", "Exception")), str(record.get("text", ""))
    stack = str(record.get("traceback", "")).rstrip()
    code = int(record.get("exit_code") or code)
    head = f"{_PROG}: rank {rank} of {nproc} failed in {fn_name}: {kind}: {text}"
    if record.get("consequence"):
        also += (
            " This error only reports that another rank went away; that rank ended "
            "without saying why (its own output above may)."
        )
    if record.get("usage") or not stack:
        message = head + also
    else:
        message = f"{head}{also}\n\nRank {rank}'s traceback:\n{stack}"
    return RankError(
        message,
        rank=rank,
        exit_code=code,
        exc_type=kind,
        exc_message=text,
        traceback=stack,
        exception=_rebuilt(record),
    )


def launch_function(
    fn: Callable[..., Any], *unnamed: Any, nproc: int | None = None, args: Sequence[Any] = ()
) -> list[Any]:
    """Run `fn(*args)` on `nproc` new processes of this machine; their results in rank order.

    Each process is one rank of a job (RANK, WORLD_SIZE, MASTER_ADDR... are set as
    `scaletrain launch` sets them), so `fn` may call `st.init()`. `nproc` defaults to
    one process per GPU, 2 without one. Blocks until every rank has ended.

    Raises ConfigError before any process starts for an `nproc` that is no process
    count, a `fn` the processes cannot import (a lambda, a local function, one defined in
    a notebook: define it at a module's top level) or `args` that cannot be sent.
    A rank's exception comes back as one RankError: the rank that failed first, its
    exception's type, message and traceback (and the exception, where it pickles).
    Ctrl-C once asks the ranks to stop (they get SIGINT) and raises KeyboardInterrupt
    once they have; twice kills them at once.
    """
    if unnamed:
        raise ConfigError(
            f"st.launch(fn, {', '.join(map(repr, unnamed))}): the process count and the "
            "function's arguments are passed by name. Fix: st.launch(fn, nproc=2, "
            "args=(...)).",
            field="nproc",
        )
    nproc = _check_nproc(nproc)
    _check_function(fn)
    arguments = _check_args(args)
    fn_name = getattr(fn, "__qualname__", None) or type(fn).__name__
    _check_call(fn, fn_name, arguments)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    # What `scaletrain launch` runs on one node (--standalone): scaletrain's rendezvous
    # at 127.0.0.1 on a free port.
    plan = Plan(
        argv=[], mode="standalone", nproc_per_node=nproc, nnodes="1", node_rank=0,
        rdzv_conf={"join_timeout": str(DEFAULT_RDZV_TIMEOUT_S)},
    )  # fmt: skip
    before = _spawned_children()

    def ours() -> list[int]:
        return sorted(_spawned_children() - before)

    interrupts = _Interrupts(quiet=False, prog=_PROG, workers=ours, forward=True)
    stopped_by: signal.Signals | None = None
    ended = False  # every rank has ended, as the agent saw it
    with contextlib.ExitStack() as stack:
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="scaletrain-launch-"))
        stack.enter_context(_signals_restored())
        cfg = LaunchConfig(nproc_per_node=nproc, log_dir=log_dir)
        stack.enter_context(_launch_environ(cfg, plan))
        os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as `python -u` for a script
        config = agent_config(plan, cfg)
        try:
            # The agent's log lines and torch.multiprocessing's ("Terminating process
            # ... via signal SIGTERM" for each rank a failure stops) say nothing the
            # RankError does not.
            with interrupts, _quiet_agent(True, _QUIET):
                results = elastic_launch(config, _rank_main)(os.getpid(), fn, *arguments)
            ended = True
        except ChildFailedError as exc:
            ended = True  # the agent stopped the others
            if interrupts.count:
                raise KeyboardInterrupt from None
            raise _rank_error(dict(exc.failures), nproc, fn_name) from None
        except SignalException as exc:
            if interrupts.count or exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            stopped_by = signal.Signals(exc.sigval)
        except RendezvousError as exc:
            raise LaunchError(
                f"{_PROG}: the ranks' rendezvous on {LOOPBACK} did not form "
                f"({type(exc).__name__}: {exc}). Expected a free local port on the loopback "
                f"interface. Fix: check that 127.0.0.1 is up and that this process may "
                f"listen on it."
            ) from None
        finally:
            # Ranks that a signal or an error in the agent left running (one that came
            # while the agent started them, before it knew of them); then reaped.
            for pid in [] if ended else ours():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            import multiprocessing

            multiprocessing.active_children()
    if interrupts.count:
        raise KeyboardInterrupt
    if stopped_by is not None:
        # The agent forwarded it to the ranks, which have ended; now it reaches this
        # process as it would have without the launch (its handler is back).
        os.kill(os.getpid(), stopped_by)
        raise LaunchError(
            f"{_PROG}: stopped by {stopped_by.name}, which was forwarded to the ranks; they "
            f"have ended."
        )
    return [_load(results[rank]) for rank in range(nproc)]
