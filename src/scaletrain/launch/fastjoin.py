"""Two costs of torch's c10d rendezvous that buy nothing, removed for one launch.

Measured on a 2-core machine (`scaletrain launch --nproc-per-node 2`, from the
agent's start to its workers' start): 0.10-0.28 s with torch's rendezvous as it
is, 0.015-0.035 s without these two costs; startup to the first step is that much
shorter, on every run.

- Before a node first joins, `DynamicRendezvousHandler.next_rendezvous` sleeps a
  random 0-0.3 s (`_delay(seconds=(0, 0.3))`), so that many nodes joining at once
  do not all hit the store in the same instant. One node (`--standalone`, the usual
  single-machine run) has no one to spread out from: that random sleep is skipped
  there, and kept for several nodes. Its other sleep, one second between polls of
  the store while waiting for a state change, is always kept.
- Every rendezvous event it records names the calling method with
  `inspect.stack()`, which reads the source of every frame on the stack and scans
  `sys.modules` for each: about 10 ms a call with torch and scaletrain imported, a
  dozen calls per start and as many at the end. The same name is
  `sys._getframe(depth).f_code.co_name`, which this puts in its place (on every
  plan: the events are the same, only cheaper).

Both are module attributes of torch.distributed.elastic.rendezvous.dynamic_rendezvous;
where a torch version lacks one, it is left alone.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["fast_rendezvous", "frame_name"]


def frame_name(depth: int = 2) -> str:
    """What `inspect.stack()[depth].function` returns, without reading any source."""
    try:
        # Frame 0 is this function's own, as inspect.stack()[0] is get_method_name's.
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _without_join_jitter(original: Any) -> Any:
    def delay(seconds: Any) -> None:
        if isinstance(seconds, tuple):  # the random join jitter, (low, high)
            return
        original(seconds)  # a poll interval: never a busy loop

    return delay


@contextlib.contextmanager
def fast_rendezvous(*, single_node: bool) -> Iterator[None]:
    """Patch torch's dynamic rendezvous module for the duration of one launch."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as module

    patches: dict[str, Any] = {"get_method_name": frame_name}
    if single_node and hasattr(module, "_delay"):
        patches["_delay"] = _without_join_jitter(module._delay)
    saved = {name: getattr(module, name) for name in patches if hasattr(module, name)}
    for name in saved:
        setattr(module, name, patches[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
