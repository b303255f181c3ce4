"""Watching a running job: the hang watchdog (more observers to come)."""

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
