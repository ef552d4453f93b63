"""Backoff, circuit breaker and clock: the relay's decisions about time, kept testable."""

from __future__ import annotations

import random
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic time, injectable for tests."""

    def monotonic(self) -> float: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()


class Backoff:
    """Exponential backoff with jitter: base * 2**attempt, capped, times a random factor."""

    JITTER_LOW = 0.5
    JITTER_HIGH = 1.5

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try number `attempt + 1` (attempt counts from 0)."""
        raw = self.base * (2 ** min(attempt, 62))
        return float(min(self.cap, raw * self.rng.uniform(self.JITTER_LOW, self.JITTER_HIGH)))


class Breaker:
    """Opens after `threshold` consecutive broker outages; stays open `cooldown` seconds."""

    def __init__(self, threshold: int, cooldown: float, clock: Clock) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None

    def record_outage(self) -> bool:
        """Count an outage; return True when this one opened the breaker."""
        self.failures += 1
        if self.opened_at is None and self.failures >= self.threshold:
            self.opened_at = self.clock.monotonic()
            return True
        if self.opened_at is not None:
            self.opened_at = self.clock.monotonic()  # still failing: another full cooldown
        return False

    def record_success(self) -> bool:
        """Reset on a successful publish; return True when the breaker was open."""
        was_open = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        return was_open

    def wait_time(self) -> float:
        """Seconds until the next attempt may be made (0 when closed or cooled down)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown - self.clock.monotonic())
