"""Celery's `task-sent` events, published by the relay when it really sends the task.

With `task_send_sent_event = True` Celery publishes a `task-sent` event right after each
task message, through the app's event exchange (`event_exchange`, `celeryev` by default),
for Flower and other event consumers. The write side cannot publish anything, so it stores
the event's fields with the row; this publisher wrapper sends the event through the relay
app's event dispatcher after the broker accepted the message. The event's timestamp,
hostname and pid are the relay's: that is when, and where from, the task was sent.

Events are best effort, as in Celery: one that cannot be published is logged and dropped,
and never changes what happens to the task's row. They go out inside the batch's claim, so
they keep its budget: the events connection gives up after --send-timeout on each connect,
read and write, and an event is sent only while one such step still fits before the claim's
deadline (the rest are dropped and logged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from outbox_notify.relay.config import SEND_TIMEOUTS_PER_STEP
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    Pending,
    Publisher,
    Result,
    bounded_connection,
    can_overlap,
    error_text,
    may_start,
    overlaps,
    start,
)

log = structlog.get_logger("outbox_notify")

EVENT_TYPE = "task-sent"


class SentEventPublisher:
    """A Publisher that adds the `task-sent` events of what the wrapped publisher sent."""

    def __init__(self, inner: Publisher, app: Any, *, send_timeout: float = 10.0) -> None:
        self.inner = inner
        self.app = app
        self.send_timeout = send_timeout  # seconds, for each step of the events connection
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
        return _EventsAfter(self, messages, start(self.inner, messages, deadline), deadline)

    def sent(
        self,
        messages: Sequence[OutgoingMessage],
        attempts: list[Attempt],
        deadline: Callable[[], bool],
    ) -> None:
        """Send the `task-sent` events of the messages that went out, while time is left."""
        sent = [
            m.spec.sent_event
            for m, a in zip(messages, attempts, strict=False)
            if m.spec.sent_event is not None and a.result is Result.PUBLISHED
        ]
        if sent:
            self._send_events(sent, deadline)

    def check(self) -> None:
        """The wrapped publisher's check."""
        self.inner.check()

    def close(self) -> None:
        """Close the wrapped publisher and the event connection."""
        self._drop()
        self.inner.close()

    def _send_events(self, events: list[dict[str, Any]], deadline: Callable[[], bool]) -> None:
        step = self.send_timeout * SEND_TIMEOUTS_PER_STEP
        done = 0
        try:
            for fields in events:
                if not may_start(deadline, step):
                    log.warning(
                        "outbox.sent_event_failed",
                        count=len(events) - done,
                        error="no time left in the batch's claim to send them",
                    )
                    return
                self._dispatcher().send(EVENT_TYPE, **fields)
                done += 1
        except Exception as exc:
            log.warning("outbox.sent_event_failed", count=len(events) - done, error=error_text(exc))
            self._drop()

    def _dispatcher(self) -> Any:
        if self.dispatcher is None:
            self.connection = bounded_connection(self.app, self.send_timeout, confirms=False)
            # An error raises (Celery would buffer the event and retry the broker at every
            # later event, each costing a connect timeout inside a claim): logged, dropped.
            self.dispatcher = self.app.events.Dispatcher(
                self.connection, enabled=True, buffer_while_offline=False
            )
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
        self,
        owner: SentEventPublisher,
        messages: Sequence[OutgoingMessage],
        inner: Pending,
        deadline: Callable[[], bool],
    ) -> None:
        self.owner = owner
        self.messages = messages
        self.inner = inner
        self.deadline = deadline

    def wait(self) -> list[Attempt]:
        attempts = self.inner.wait()
        self.owner.sent(self.messages, attempts, self.deadline)
        return attempts

    def cancel(self) -> None:
        self.inner.cancel()
