"""OpenTelemetry spans for the relay's claims and publishes, linked to each message's trace.

A relay's span is never a message's parent: one claim or one publish serves many messages of
many traces, and the worker continues each request's own trace from the message's
`traceparent`. So `outbox.claim` and `outbox.publish` are roots of their own, each linked to
the span context of every message in its batch (OpenTelemetry's model for batch messaging).

Imported only where the OpenTelemetry API is installed (outbox_notify.otel decides).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer

from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    Pending,
    Publisher,
    Result,
    can_overlap,
    overlaps,
    start,
)
from outbox_notify.relay.store import ClaimedRow, OpenClaim, Peek, QueueGauges, Store

CLAIM_SPAN = "outbox.claim"
PUBLISH_SPAN = "outbox.publish"
BATCH_SIZE = "messaging.batch.message_count"  # OpenTelemetry's messaging conventions
SYSTEM = "messaging.system"


def link_to(carrier: Mapping[str, Any]) -> Link | None:
    """A link to the span context the headers in `carrier` name; None when they name none."""
    if not carrier:
        return None
    extracted = propagate.extract(carrier, context=Context())
    span_context = trace.get_current_span(extracted).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def _row_carrier(row: ClaimedRow) -> Mapping[str, Any]:
    """The trace headers captured with the row at enqueue (outbox_notify._write.context)."""
    if '"otel"' not in row.context:
        return {}
    try:
        context = json.loads(row.context)
    except ValueError:
        return {}  # the message's own decoder reports an unusable row
    otel = context.get("otel") if isinstance(context, dict) else None
    return otel if isinstance(otel, dict) else {}


def _links(carriers: Iterator[Mapping[str, Any]]) -> list[Link]:
    return [link for link in map(link_to, carriers) if link is not None]


class TracingStore:
    """A Store whose non-empty claims are recorded as `outbox.claim` spans."""

    def __init__(self, inner: Store, tracer: Tracer) -> None:
        self.inner = inner
        self.tracer = tracer

    def connect(self) -> None:
        self.inner.connect()

    def close(self) -> None:
        self.inner.close()

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[OpenClaim]:
        """The wrapped store's claim; a span from its start to its rows' arrival."""
        started = time.time_ns()
        with self.inner.claim(limit, lock_wait=lock_wait) as claim:
            if claim.rows:  # an idle relay's empty claims would only be noise
                self.record(claim.rows, started)
            yield claim

    def record(self, rows: Sequence[ClaimedRow], started: int) -> None:
        """One finished `outbox.claim` span for `rows`, linked to their traces."""
        span = self.tracer.start_span(
            CLAIM_SPAN,
            context=Context(),  # a root: never the child of whatever is current
            kind=SpanKind.CONSUMER,
            links=_links(_row_carrier(row) for row in rows),
            attributes={BATCH_SIZE: len(rows)},
            start_time=started,
        )
        span.end()

    def peek(self) -> Peek:
        return self.inner.peek()

    def queue_gauges(self) -> QueueGauges:
        return self.inner.queue_gauges()

    def send_probe(self, payload: str) -> None:
        self.inner.send_probe(payload)

    def session_proven(self) -> None:
        self.inner.session_proven()


class TracingPublisher:
    """A Publisher whose batches are recorded as `outbox.publish` spans, from the first write
    to the outcome (the broker's confirms, where it gives them)."""

    def __init__(self, inner: Publisher, tracer: Tracer, *, system: str = "") -> None:
        self.inner = inner
        self.tracer = tracer
        self.system = system

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
        """Publish a batch under its span."""
        return self.start(messages, deadline).wait()

    def start(self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Pending:
        """Start a batch (the wrapped publisher's way) and open its span."""
        attributes: dict[str, Any] = {BATCH_SIZE: len(messages)}
        if self.system:
            attributes[SYSTEM] = self.system
        span = self.tracer.start_span(
            PUBLISH_SPAN,
            context=Context(),
            kind=SpanKind.PRODUCER,
            links=_links(m.headers for m in messages),
            attributes=attributes,
        )
        try:
            return _Traced(start(self.inner, messages, deadline), span)
        except BaseException as exc:
            _fail(span, exc)
            raise

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()


def _fail(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    span.end()


class _Traced:
    """A started batch whose span ends with its outcome."""

    def __init__(self, pending: Pending, span: Span) -> None:
        self.pending = pending
        self.span = span

    def wait(self) -> list[Attempt]:
        try:
            attempts = self.pending.wait()
        except BaseException as exc:
            _fail(self.span, exc)
            raise
        failed = sum(1 for attempt in attempts if attempt.result is not Result.PUBLISHED)
        self.span.set_attribute("outbox.published", len(attempts) - failed)
        if failed:
            self.span.set_attribute("outbox.not_published", failed)
            self.span.set_status(Status(StatusCode.ERROR, f"{failed} not published"))
        self.span.end()
        return attempts

    def cancel(self) -> None:
        self.pending.cancel()
        self.span.set_attribute("outbox.cancelled", True)
        self.span.end()
