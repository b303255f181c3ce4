"""Every exit code scaletrain's commands and workers use, in one place.

Distinct codes let a launcher, a shell script or a scheduler's retry policy tell
what happened without reading the output: 75 ("try again") is worth requeueing,
86 (a hang) deserves a look at the stacks, 2 needs the user to fix a flag.
"""

from __future__ import annotations

__all__ = [
    "EXIT_ABORTED",
    "EXIT_ERROR",
    "EXIT_HANG",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
]

EXIT_OK = 0
"""Finished (or stopped on purpose by --stop-after, saved)."""

EXIT_ERROR = 1
"""An error in training that is not the user's input: the failing rank's traceback is shown."""

EXIT_USAGE = 2
"""Bad input (a flag, a config file, a dataset, a checkpoint, a strategy that does not fit):
the message says what was received, what was expected and how to fix it."""

EXIT_PREEMPTED = 75
"""Stopped by a signal (SIGTERM, SIGUSR1 or a first Ctrl-C) after saving: sysexits'
EX_TEMPFAIL, "try again". Requeue the job and the next start resumes."""

EXIT_HANG = 86
"""Ended by the hang watchdog: some rank made no progress for --hang-timeout seconds.
Distinct from 1 (an exception), 2 (a usage error) and the signal codes (128 + N)."""

EXIT_ABORTED = 130
"""Aborted by a second Ctrl-C: the workers were killed at once, nothing more was saved
(128 + SIGINT, as a shell reports it)."""
