"""A circuit breaker for calls that must never slow their caller down for long (the remote drafter).

States: *closed* (every call goes out) → after ``threshold`` failures in a row, *open* for ``cooldown_s`` (no call
goes out: the caller proceeds at once without the result) → then *half-open*: one trial call; its success
closes the breaker and resets the cooldown, its failure opens it again for twice as long, up to
``max_cooldown_s``. So a dead or slow service costs its caller ``threshold`` failed waits, then one per
cooldown, the cooldowns growing while it stays bad: at most ``threshold + log2(T / cooldown_s) + T /
max_cooldown_s`` failed waits over a time ``T``.

Time is whatever the caller passes as ``now`` (``time.monotonic()``); not thread-safe (one caller thread).
"""
from __future__ import annotations


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown_s: float = 2.0, max_cooldown_s: float = 60.0) -> None:
        if threshold < 1 or cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError("threshold >= 1 and 0 < cooldown_s <= max_cooldown_s")
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self.cooldown_s = cooldown_s
        self.failures_in_row = 0
        self.open_until: float | None = None  # None: closed
        self.trial = False                    # a half-open trial call is out
        self.skipped = 0                      # calls not made while open
        self.opened = 0                       # times it opened

    @property
    def state(self) -> str:
        return "closed" if self.open_until is None else ("half-open" if self.trial else "open")

    def allow(self, now: float) -> bool:
        """May a call go out now? While open: no (counted in ``skipped``) until the cooldown ends, then one trial."""
        if self.open_until is None:
            return True
        if now >= self.open_until and not self.trial:
            self.trial = True
            return True
        self.skipped += 1
        return False

    def success(self) -> None:
        self.failures_in_row, self.open_until, self.trial = 0, None, False
        self.cooldown_s = self.base_cooldown_s

    def failure(self, now: float) -> None:
        self.failures_in_row += 1
        if self.trial:  # the trial failed: open again, for longer
            self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self.open_until, self.trial = now + self.cooldown_s, False
            self.opened += 1
        elif self.open_until is None and self.failures_in_row >= self.threshold:
            self.open_until = now + self.cooldown_s
            self.opened += 1
