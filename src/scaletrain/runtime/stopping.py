"""When every rank of a run stops: at the same step, agreed off the hot path.

--stop-after counts steps, the same on every rank: no agreement is needed. A signal
(Ctrl-C, SIGTERM, SIGUSR1) reaches ranks at different times, so after every step each
rank starts a tiny all-reduce of its flag without waiting for it (rt.any_rank_async) and
collects the previous step's: every rank sees the same answer at the same step, one step
after the signal, and the round trip runs on the control group's threads while the next
step computes. (A blocking rt.any_rank after every step made each step wait for the
slowest rank's arrival there: the ledger's "sync" phase, 3-5 ms a step on a busy 2-core
machine.)

`scaletrain train` holds one StopAgreement; a loop of one's own gets the same through
`rt.should_stop()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.dist import PendingFlag
from scaletrain.errors import spell
from scaletrain.runtime.signals import StopRequest

if TYPE_CHECKING:
    from scaletrain.runtime.core import Runtime

__all__ = ["StopAgreement"]

OTHER_RANK = "a signal on another rank"


class StopAgreement:
    def __init__(self, rt: Runtime, stop: StopRequest, stop_after: int | None) -> None:
        self.rt, self.stop, self.stop_after = rt, stop, stop_after
        self._pending: PendingFlag | None = None

    def at_start(self) -> str | None:
        """Before the first step (a stop asked for during set-up): one blocking agreement."""
        if self.rt.any_rank(self.stop.signal is not None):
            return self.stop.reason or OTHER_RANK
        return None

    def after_step(self, steps_this_run: int, *, last: bool = False) -> str | None:
        """Why every rank stops after this step, or None to go on.

        `last`: this step is the run's last. Reaching the run's length finishes the
        run (evaluation, model.pt), so --stop-after that lands there stops nothing.
        """
        reason = self.collect()
        stop_after = self.stop_after
        if reason is None and not last and stop_after is not None and steps_this_run >= stop_after:
            reason = spell("stop_after", stop_after)
        if reason is None:
            self._pending = self.rt.any_rank_async(self.stop.signal is not None)
        return reason

    def collect(self) -> str | None:
        """The flag the last step started, if one is in flight (every rank calls this at
        the same point: the end of an epoch)."""
        pending, self._pending = self._pending, None
        if pending is None or not pending.result():
            return None
        return (self.stop.reason if self.stop.signal is not None else None) or OTHER_RANK
