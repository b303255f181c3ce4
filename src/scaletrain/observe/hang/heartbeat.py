"""What a watchdog watches: its timing settings and one rank's published heartbeat."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from scaletrain.errors import ConfigError
from scaletrain.exitcodes import EXIT_HANG

__all__ = ["DEFAULT_HANG_TIMEOUT_S", "EXIT_HANG", "Heartbeat", "WatchdogConfig"]

DEFAULT_HANG_TIMEOUT_S = 300.0
"""Seconds without a beat before a rank counts as hung (`--hang-timeout`): far above a
normal step, far below the process group's 30-minute collective timeout."""


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """How long a rank may go without a beat, and how often the thread looks."""

    timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """Seconds without a beat after which this rank is hung (`--hang-timeout`)."""
    poll_s: float | None = None
    """Seconds between heartbeat publications and checks; None: timeout_s / 10,
    clamped to [0.05, 5]."""
    grace_s: float | None = None
    """Seconds the reporter waits for the other ranks to dump their stacks (a rank
    silent by then is dead or frozen), and as long again for their collective traces,
    before it reports and every rank exits; None: max(2, 3 x poll_s)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s)):
            raise ConfigError(
                f"hang timeout_s={self.timeout_s!r} is not a number; expected seconds, "
                "e.g. 300 (--hang-timeout 300)."
            )
        if self.timeout_s <= 0:
            raise ConfigError(
                f"hang timeout_s={self.timeout_s!r} must be positive: the seconds a rank "
                "may go without a beat, e.g. 300. To turn the watchdog off, do not create one."
            )
        if self.poll_s is None:
            self.poll_s = min(max(self.timeout_s / 10.0, 0.05), 5.0)
        if not (math.isfinite(self.poll_s) and 0 < self.poll_s <= self.timeout_s):
            raise ConfigError(
                f"poll_s={self.poll_s!r} must be in (0, timeout_s={self.timeout_s}]: the "
                "thread checks for a hang every poll_s seconds. Leave it unset for "
                "timeout_s / 10."
            )
        if self.grace_s is None:
            self.grace_s = max(2.0, 3.0 * self.poll_s)
        if not (math.isfinite(self.grace_s) and self.grace_s >= self.poll_s):
            raise ConfigError(
                f"grace_s={self.grace_s!r} must be >= poll_s={self.poll_s}: the other "
                "ranks look for the dump request every poll_s seconds, a shorter grace "
                "ends the job before they have written their stacks. Leave it unset for "
                "max(2, 3 x poll_s)."
            )


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One rank's progress as its watchdog thread last published it."""

    rank: int
    """Global rank."""
    step: int = -1
    """Step of the last beat; -1 before the first one."""
    phase: str = "start"
    """Phase of the last beat ("forward", "eval", ...)."""
    idle_s: float = 0.0
    """Seconds since the last beat, when this heartbeat was published."""
    seq: int | None = None
    """Collectives this rank had issued on the default process group (None: unknown)."""
    collective: str | None = None
    """The torch.distributed call the training thread is blocked in ("all_reduce"),
    "" when it is outside torch.distributed, None when unknown."""
    where: str = ""
    """The training thread's innermost frame outside torch: "train.py:42 in step"."""
    stopped: bool = False
    """True once the rank called Watchdog.stop(): it finished, it will not beat again."""
    host: str = ""
    """Host name of the rank's machine."""
    pid: int = 0
    """Process id of the rank."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
