"""Watching a running job: the loop's events, the hang watchdog (more observers to come).

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
    from scaletrain.observe.message import format_hang_message
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
    "HangDiagnosis",
    "HangReport",
    "Heartbeat",
    "Watchdog",
    "WatchdogConfig",
    "configure_flight_recorder",
    "dump_stacks",
    "find_laggards",
    "format_hang_message",
]


__getattr__, __dir__ = lazy_attributes("scaletrain.observe", globals(), _WHERE)
