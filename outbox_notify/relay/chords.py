"""The relay makes a chord's result-backend calls before it publishes the chord's header.

Rows of schema version 2 carry the calls Celery would have made on the result backend when
the chord was applied (outbox_notify/_chord_calls.py: the chord size, a header of groups). This
publisher wrapper makes them, with the relay app's result backend, before the wrapped
publisher sends the rows that carry them; a header task can then never finish before the
backend knows its chord. Each call is made once per relay process (its id is remembered);
another relay, or this one after a restart, makes it again, which sets the same keys again.

A result backend that cannot be reached is an outage, like a broker outage: the rows that
need it are not published, their retries are not spent, and the relay tries again later
(its breaker and cooldown apply). Any other error of a call is that row's failure (a retry
spent, and in the end a dead letter with the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog

from outbox_notify import _chord_calls as chord_calls
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    OUTAGE_ERRORS,
    Attempt,
    Pending,
    Publisher,
    Result,
    broker_refuses_writes,
    can_overlap,
    error_text,
    overlaps,
    start,
)

log = structlog.get_logger("outbox_notify")

REMEMBERED_CALLS = 10_000  # call ids a relay remembers as made
# Connection-level error classes of the clients result backends use (redis-py's do not
# derive from the built-in ConnectionError), matched by name so none is imported.
_UNREACHABLE_NAMES = frozenset(
    {"ConnectionError", "TimeoutError", "BusyLoadingError", "OperationalError"}
)


def unreachable(exc: BaseException) -> bool:
    """Whether a result-backend error means the backend cannot be used right now."""
    if isinstance(exc, OUTAGE_ERRORS) or broker_refuses_writes(exc):
        return True
    return any(klass.__name__ in _UNREACHABLE_NAMES for klass in type(exc).__mro__)


class ChordPublisher:
    """A Publisher that makes the rows' result-backend calls before the wrapped one publishes."""

    def __init__(self, inner: Publisher, app: Any) -> None:
        self.inner = inner
        self.app = app
        self.made: dict[str, None] = {}  # ids of calls made, oldest first

    @property
    def overlapping(self) -> bool:
        """Whether the wrapped publisher can have two batches in flight."""
        return overlaps(self.inner)

    def can_overlap(self) -> bool:
        """Whether the wrapped publisher can start another batch without connecting."""
        return can_overlap(self.inner)

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Make the calls of the messages that carry some, then publish the ready ones."""
        return self.start(messages, deadline).wait()

    def start(self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Pending:
        """Make the calls of the messages that carry some, then start the ready ones."""
        held: dict[int, Attempt] = {}
        for index, message in enumerate(messages):
            if message.spec.backend_calls:
                failure = self._make(message.spec.backend_calls)
                if failure is not None:
                    held[index] = failure
        if not held:
            return start(self.inner, messages, deadline)
        ready = [m for i, m in enumerate(messages) if i not in held]
        return _Merged(held, len(messages), start(self.inner, ready, deadline) if ready else None)

    def check(self) -> None:
        """The wrapped publisher's check (the result backend is needed by chords only)."""
        self.inner.check()

    def close(self) -> None:
        """Close the wrapped publisher."""
        self.inner.close()

    def _make(self, calls: list[dict[str, Any]]) -> Attempt | None:
        for call in calls:
            call_id = str(call.get("id", ""))
            if call_id and call_id in self.made:
                continue
            try:
                chord_calls.apply(self.app.backend, self.app, call)
            except Exception as exc:
                return self._failed(call, exc)
            if call_id:
                self._remember(call_id)
        return None

    def _failed(self, call: dict[str, Any], exc: Exception) -> Attempt:
        error = f"result backend: {error_text(exc)}"
        if unreachable(exc):
            log.warning("outbox.result_backend_unavailable", call=call.get("call"), error=error)
            return Attempt(Result.OUTAGE, error)
        log.error("outbox.result_backend_call_failed", call=call.get("call"), error=error)
        return Attempt(Result.FAILED, error)

    def _remember(self, call_id: str) -> None:
        self.made[call_id] = None
        if len(self.made) > REMEMBERED_CALLS:
            del self.made[next(iter(self.made))]


class _Merged:
    """The attempts of the messages held back, merged with the wrapped batch's."""

    def __init__(self, held: dict[int, Attempt], count: int, inner: Pending | None) -> None:
        self.held = held
        self.count = count
        self.inner = inner

    def wait(self) -> list[Attempt]:
        published = iter(self.inner.wait() if self.inner is not None else [])
        return [self.held[i] if i in self.held else next(published) for i in range(self.count)]

    def cancel(self) -> None:
        if self.inner is not None:
            self.inner.cancel()
