"""One injectable source of time for the block store: every expiry, last-use stamp and GC decision reads it.

Times are wall-clock seconds since the epoch (floats), not monotonic: expiries are written to the SSD and must
mean the same thing after a restart. ``FakeClock`` lets tests move days in microseconds.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> float`` (wall-clock seconds)."""

    def now(self) -> float: ...


class SystemClock:
    """The real clock: ``time.time()``."""

    def now(self) -> float:
        return time.time()


class FakeClock:
    """A clock that only moves when told to (tests). Invariant: ``now()`` never goes backwards."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward ``seconds`` (≥ 0); returns the new time."""
        if seconds < 0:
            raise ValueError("FakeClock only moves forward")
        self._now += seconds
        return self._now
