"""Watching a running job: the loop's events, the hang watchdog, the step ledger (where the
time goes), stragglers, profiles and the report.

Names are imported on first use: the train config reads DEFAULT_HANG_TIMEOUT_S from
here without importing torch (the CLI's --help stays instant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain._lazy import lazy_attributes

if TYPE_CHECKING:
    from scaletrain.observe.diagnosis import HangDiagnosis, find_laggards
    from scaletrain.observe.flight_recorder import FLIGHT_RECORDER_DIR, configure_flight_recorder
    from scaletrain.observe.heartbeat import (
        DEFAULT_HANG_TIMEOUT_S,
        EXIT_HANG,
        Heartbeat,
        WatchdogConfig,
    )
    from scaletrain.observe.ledger import LedgerConfig, StepLedger
    from scaletrain.observe.message import format_hang_message
    from scaletrain.observe.phases import PHASES
    from scaletrain.observe.records import peak_memory, phase_medians, read_run
    from scaletrain.observe.report import write_report
    from scaletrain.observe.stacks import dump_stacks
    from scaletrain.observe.watchdog import HANG_DIR, HangReport, Watchdog

_WHERE = {
    "HangDiagnosis": "scaletrain.observe.diagnosis",
    "find_laggards": "scaletrain.observe.diagnosis",
    "FLIGHT_RECORDER_DIR": "scaletrain.observe.flight_recorder",
    "configure_flight_recorder": "scaletrain.observe.flight_recorder",
    "DEFAULT_HANG_TIMEOUT_S": "scaletrain.observe.heartbeat",
    "EXIT_HANG": "scaletrain.observe.heartbeat",
    "Heartbeat": "scaletrain.observe.heartbeat",
    "WatchdogConfig": "scaletrain.observe.heartbeat",
    "format_hang_message": "scaletrain.observe.message",
    "LedgerConfig": "scaletrain.observe.ledger",
    "StepLedger": "scaletrain.observe.ledger",
    "PHASES": "scaletrain.observe.phases",
    "peak_memory": "scaletrain.observe.records",
    "phase_medians": "scaletrain.observe.records",
    "read_run": "scaletrain.observe.records",
    "write_report": "scaletrain.observe.report",
    "dump_stacks": "scaletrain.observe.stacks",
    "HANG_DIR": "scaletrain.observe.watchdog",
    "HangReport": "scaletrain.observe.watchdog",
    "Watchdog": "scaletrain.observe.watchdog",
}

__all__ = [
    "DEFAULT_HANG_TIMEOUT_S",
    "EXIT_HANG",
    "FLIGHT_RECORDER_DIR",
    "HANG_DIR",
    "PHASES",
    "HangDiagnosis",
    "HangReport",
    "Heartbeat",
    "LedgerConfig",
    "StepLedger",
    "Watchdog",
    "WatchdogConfig",
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
