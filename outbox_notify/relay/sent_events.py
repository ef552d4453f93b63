"""Celery's `task-sent` events, published by the relay when it really sends the task.

With `task_send_sent_event = True` Celery publishes a `task-sent` event right after each
task message, through the app's event exchange (`event_exchange`, `celeryev` by default),
for Flower and other event consumers. The write side cannot publish anything, so it stores
the event's fields with the row; this publisher wrapper sends the event through the relay
app's event dispatcher after the broker accepted the message. The event's timestamp,
hostname and pid are the relay's: that is when, and where from, the task was sent.

Events are best effort, as in Celery: one that cannot be published is logged and dropped,
and never changes what happens to the task's row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    Pending,
    Publisher,
    Result,
    can_overlap,
    error_text,
    overlaps,
    start,
)

log = structlog.get_logger("outbox_notify")

EVENT_TYPE = "task-sent"


class SentEventPublisher:
    """A Publisher that adds the `task-sent` events of what the wrapped publisher sent."""

    def __init__(self, inner: Publisher, app: Any) -> None:
        self.inner = inner
        self.app = app
        self.connection: Any = None
        self.dispatcher: Any = None

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
        """Publish through the wrapped publisher, then the events of what went out."""
        return self.start(messages, deadline).wait()

    def start(self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Pending:
        """Start the wrapped publisher's batch; its events go out once its outcome is known."""
        return _EventsAfter(self, messages, start(self.inner, messages, deadline))

    def sent(self, messages: Sequence[OutgoingMessage], attempts: list[Attempt]) -> None:
        """Send the `task-sent` events of the messages that went out."""
        sent = [
            m.spec.sent_event
            for m, a in zip(messages, attempts, strict=False)
            if m.spec.sent_event is not None and a.result is Result.PUBLISHED
        ]
        if sent:
            self._send_events(sent)

    def check(self) -> None:
        """The wrapped publisher's check."""
        self.inner.check()

    def close(self) -> None:
        """Close the wrapped publisher and the event connection."""
        self._drop()
        self.inner.close()

    def _send_events(self, events: list[dict[str, Any]]) -> None:
        try:
            dispatcher = self._dispatcher()
            for fields in events:
                dispatcher.send(EVENT_TYPE, **fields)
        except Exception as exc:
            log.warning("outbox.sent_event_failed", count=len(events), error=error_text(exc))
            self._drop()

    def _dispatcher(self) -> Any:
        if self.dispatcher is None:
            self.connection = self.app.connection_for_write()
            self.dispatcher = self.app.events.Dispatcher(self.connection, enabled=True)
        return self.dispatcher

    def _drop(self) -> None:
        with contextlib.suppress(Exception):
            if self.dispatcher is not None:
                self.dispatcher.close()
            if self.connection is not None:
                self.connection.release()
        self.dispatcher = self.connection = None


class _EventsAfter:
    """A wrapped Pending whose wait() also sends the events of what went out."""

    def __init__(
        self, owner: SentEventPublisher, messages: Sequence[OutgoingMessage], inner: Pending
    ) -> None:
        self.owner = owner
        self.messages = messages
        self.inner = inner

    def wait(self) -> list[Attempt]:
        attempts = self.inner.wait()
        self.owner.sent(self.messages, attempts)
        return attempts

    def cancel(self) -> None:
        self.inner.cancel()
