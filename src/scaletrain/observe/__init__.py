"""Watching a running job, in three rooms around the loop's events:

- `events` (here): what a training loop tells the things that watch it; `output`: output
  that only reports and never stops training.
- `hang/`: the hang watchdog, its heartbeats, stacks and diagnosis.
- `metrics/`: the step ledger (where the time goes), stragglers, MFU, memory, profiles.
- `report/`: the HTML report and the experiment trackers, from what the others recorded.

Names are imported on first use: the train config reads DEFAULT_HANG_TIMEOUT_S from
here without importing torch (the CLI's --help stays instant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain._lazy import lazy_attributes

if TYPE_CHECKING:
    from scaletrain.observe.events import EvalEvent, EventBus, LoopObserver, RunInfo, StepEvent
    from scaletrain.observe.hang.diagnosis import HangDiagnosis, find_laggards
    from scaletrain.observe.hang.flight_recorder import (
        FLIGHT_RECORDER_DIR,
        configure_flight_recorder,
    )
    from scaletrain.observe.hang.heartbeat import (
        DEFAULT_HANG_TIMEOUT_S,
        EXIT_HANG,
        Heartbeat,
        WatchdogConfig,
    )
    from scaletrain.observe.hang.message import format_hang_message
    from scaletrain.observe.hang.stacks import dump_stacks
    from scaletrain.observe.hang.watchdog import HANG_DIR, HangReport, Watchdog, WatchdogObserver
    from scaletrain.observe.metrics.ledger import LedgerConfig, StepLedger
    from scaletrain.observe.metrics.phases import PHASES
    from scaletrain.observe.metrics.records import peak_memory, phase_medians, read_run
    from scaletrain.observe.report.html import write_report

_WHERE = {
    "EvalEvent": "scaletrain.observe.events",
    "EventBus": "scaletrain.observe.events",
    "LoopObserver": "scaletrain.observe.events",
    "RunInfo": "scaletrain.observe.events",
    "StepEvent": "scaletrain.observe.events",
    "HangDiagnosis": "scaletrain.observe.hang.diagnosis",
    "find_laggards": "scaletrain.observe.hang.diagnosis",
    "FLIGHT_RECORDER_DIR": "scaletrain.observe.hang.flight_recorder",
    "configure_flight_recorder": "scaletrain.observe.hang.flight_recorder",
    "DEFAULT_HANG_TIMEOUT_S": "scaletrain.observe.hang.heartbeat",
    "EXIT_HANG": "scaletrain.observe.hang.heartbeat",
    "Heartbeat": "scaletrain.observe.hang.heartbeat",
    "WatchdogConfig": "scaletrain.observe.hang.heartbeat",
    "format_hang_message": "scaletrain.observe.hang.message",
    "LedgerConfig": "scaletrain.observe.metrics.ledger",
    "StepLedger": "scaletrain.observe.metrics.ledger",
    "PHASES": "scaletrain.observe.metrics.phases",
    "peak_memory": "scaletrain.observe.metrics.records",
    "phase_medians": "scaletrain.observe.metrics.records",
    "read_run": "scaletrain.observe.metrics.records",
    "write_report": "scaletrain.observe.report.html",
    "dump_stacks": "scaletrain.observe.hang.stacks",
    "HANG_DIR": "scaletrain.observe.hang.watchdog",
    "HangReport": "scaletrain.observe.hang.watchdog",
    "Watchdog": "scaletrain.observe.hang.watchdog",
    "WatchdogObserver": "scaletrain.observe.hang.watchdog",
}

__all__ = [
    "DEFAULT_HANG_TIMEOUT_S",
    "EXIT_HANG",
    "FLIGHT_RECORDER_DIR",
    "HANG_DIR",
    "PHASES",
    "EvalEvent",
    "EventBus",
    "HangDiagnosis",
    "HangReport",
    "Heartbeat",
    "LedgerConfig",
    "LoopObserver",
    "RunInfo",
    "StepEvent",
    "StepLedger",
    "Watchdog",
    "WatchdogConfig",
    "WatchdogObserver",
    "configure_flight_recorder",
    "dump_stacks",
    "find_laggards",
    "format_hang_message",
    "peak_memory",
    "phase_medians",
    "read_run",
    "write_report",
]


__getattr__, __dir__ = lazy_attributes("scaletrain.observe", globals(), _WHERE)
