"""Watching a running job: the hang watchdog (more observers to come)."""

from scaletrain.observe.watchdog import (
    DEFAULT_HANG_TIMEOUT_S,
    EXIT_HANG,
    FLIGHT_RECORDER_DIR,
    HANG_DIR,
    HangDiagnosis,
    HangReport,
    Heartbeat,
    Watchdog,
    WatchdogConfig,
    configure_flight_recorder,
    dump_stacks,
    find_laggards,
    format_hang_message,
)

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
