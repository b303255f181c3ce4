"""The step ledger as a LoopObserver of `scaletrain train` (scaletrain.observe.events).

The ledger measures through its hooks (the trainer's loop is a plain loop on rt.setup
and rt.loader); this observer tells it what hooks cannot see: the run directory and the
step a resumed run starts at, when evaluation ends, when the run ends (the whole-run
summary is gathered from every rank then, a collective every rank reaches).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.observe.events import EvalEvent, LoopObserver, RunInfo
from scaletrain.observe.metrics.ledger import StepLedger

__all__ = ["LedgerObserver"]


class LedgerObserver(LoopObserver):
    """On every rank. `profile`: a window of steps ("10-15") to record with torch.profiler."""

    def __init__(self, ledger: StepLedger, *, profile: str | None = None) -> None:
        self.ledger = ledger
        self.profile = profile

    def on_run_start(self, info: RunInfo) -> None:
        ledger = self.ledger
        ledger.set_start_step(info.start_step)
        ledger.set_out(info.out)
        if self.profile is None:
            return
        from scaletrain.observe.metrics.profiling import arm_profile, parse_steps, window_past_end

        first, last = parse_steps(self.profile)
        if first > info.total_steps:
            raise window_past_end(self.profile, info.total_steps)
        if info.start_step >= first:
            ledger.say(
                f"scaletrain: the profile window {first}-{last} is behind this resumed run "
                f"(it starts at step {info.start_step}): not recorded again."
            )
            return
        arm_profile(ledger, (first, last), info.out, rank=info.rank, world_size=info.world_size)

    def on_eval(self, event: EvalEvent) -> None:
        self.ledger.end_eval()

    def on_stop(self, step: int, total_steps: int, reason: str, path: Path | None) -> None:
        self.ledger.finish(collective=True)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self.ledger.finish(collective=True)

    def close(self) -> None:
        # A failed run: no collective (a peer may be gone); the files are closed.
        self.ledger.close()
