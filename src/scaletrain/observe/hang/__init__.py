"""Hang detection: a job whose ranks stopped making progress ends, naming who and where.

- `heartbeat`: the watchdog's settings and one rank's published heartbeat.
- `store`: the key-value store the ranks' watchdogs meet in.
- `stacks`: a rank's Python stacks and its collective count, read from another thread.
- `flight_recorder`: torch's collective flight recorder, turned on and dumped.
- `diagnosis`: who did not arrive, from every rank's heartbeat (pure rules).
- `message`: the one paragraph a hang prints.
- `watchdog`: the thread per rank that ties them together, and `WatchdogObserver`, which
  beats it from the loop's events.

Importing this package imports nothing: the train config reads DEFAULT_HANG_TIMEOUT_S
from `heartbeat` without torch.
"""

__all__: list[str] = []
