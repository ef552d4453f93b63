"""Sentry and structlog context carried from the enqueue to the publish, and without them."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
import sentry_sdk
import structlog
from django.db import transaction
from sentry_sdk.transport import Transport

from outbox_notify import observability
from outbox_notify._write import context
from outbox_notify.relay.outcome import Decided
from outbox_notify.relay.store import ClaimedRow, Dead, Outcome, Retry
from tests.celery_app import add

pytestmark = pytest.mark.django_db


class MemoryTransport(Transport):
    """Keeps Sentry envelopes in memory instead of sending them."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.envelopes: list[Any] = []

    def capture_envelope(self, envelope: Any) -> None:
        self.envelopes.append(envelope)

    def messages(self) -> list[str]:
        found = []
        for envelope in self.envelopes:
            for item in envelope.items:
                event = item.get_event()
                if event and event.get("message"):
                    found.append(event["message"])
        return found


@pytest.fixture
def sentry() -> Iterator[MemoryTransport]:
    """An initialised Sentry client whose events stay in memory; reset afterwards."""
    transport = MemoryTransport()
    # No integrations: Sentry's own Celery integration would patch Celery globally (and add
    # trace headers itself), which would leak into the other tests.
    sentry_sdk.init(
        dsn="https://public@sentry.invalid/1",
        transport=transport,
        traces_sample_rate=1.0,
        default_integrations=False,
        auto_enabling_integrations=False,
    )
    try:
        yield transport
    finally:
        # No DSN: inactive again (and still no integrations patching Celery).
        sentry_sdk.init(default_integrations=False, auto_enabling_integrations=False)


def test_sentry_trace_and_baggage_travel_as_message_headers(
    sentry: MemoryTransport, drain_outbox: Any
) -> None:
    """The trace active at enqueue arrives as the message's sentry-trace/baggage headers."""
    with sentry_sdk.start_transaction(name="checkout") as span, transaction.atomic():
        add.delay(1, 2)
        trace_id = span.trace_id
    [message] = drain_outbox()
    assert message.headers["sentry-trace"].startswith(trace_id)
    assert "sentry-trace_id=" + trace_id in message.headers["baggage"]


def test_no_sentry_headers_without_an_initialised_client(drain_outbox: Any) -> None:
    """With the SDK installed but not initialised, no trace headers are invented."""
    with transaction.atomic():
        add.delay(1, 2)
    [message] = drain_outbox()
    assert "sentry-trace" not in message.headers


def test_context_capture_works_without_sentry_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """If sentry_sdk cannot be imported, enqueue still captures structlog context."""
    real_import = builtins.__import__

    def no_sentry(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "sentry_sdk" or name.startswith("sentry_sdk."):
            raise ImportError("sentry_sdk is not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sentry)
    structlog.contextvars.bind_contextvars(request_id="r-7")
    try:
        assert context.capture() == {"structlog": {"request_id": "r-7"}}
        observability.report_to_sentry(task_id="t", task_name="n", retries=1, error="e", dead=False)
    finally:
        structlog.contextvars.clear_contextvars()


def test_structlog_context_is_bound_around_the_publish(
    drain_outbox: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context bound at enqueue is bound again while the relay publishes that message."""
    from outbox_notify.testing import RecordingPublisher

    seen: list[dict[str, Any]] = []
    original = RecordingPublisher.publish

    def spy(self: Any, messages: Any, deadline: Any) -> Any:
        for message in messages:
            with structlog.contextvars.bound_contextvars(**message.log_context):
                seen.append(structlog.contextvars.get_contextvars())
        return original(self, messages, deadline)

    monkeypatch.setattr(RecordingPublisher, "publish", spy)
    structlog.contextvars.bind_contextvars(request_id="req-42")
    try:
        with transaction.atomic():
            add.delay(1, 1)
    finally:
        structlog.contextvars.clear_contextvars()
    drain_outbox()
    assert seen == [{"request_id": "req-42"}]


def _row(n: int, retries: int) -> ClaimedRow:
    return ClaimedRow(
        n, f"task-{n}", "tests.add", "[]", "{}", "{}", "{}", retries, 1, dt.datetime.now(dt.UTC)
    )


def test_sentry_hears_of_a_row_once_when_it_starts_failing_and_once_when_it_dies(
    sentry: MemoryTransport,
) -> None:
    """First failure and dead-lettering are reported; retries in between are not."""
    from outbox_notify.relay.reporting import BatchReport, Reporters
    from outbox_notify.relay.runner import reporters

    first, again, dead = _row(1, 0), _row(2, 3), _row(3, 5)
    decided = Decided(
        outcome=Outcome(),
        published=[],
        retried=[
            (first, Retry(id=1, retries=1, delay=1.0, error="e1")),
            (again, Retry(id=2, retries=4, delay=1.0, error="e2")),
        ],
        dead=[(dead, Dead(id=3, retries=6, reason="gone"))],
        outages=0,
        skipped=0,
    )
    # The reporters a real relay gets (runner.reporters()), told of one committed batch.
    Reporters(reporters()).batch_committed(
        BatchReport(decided=decided, claimed=3, seconds=0.01, lag=None)
    )
    sentry_sdk.flush()
    assert sorted(sentry.messages()) == [
        "outbox message dead-lettered: tests.add",
        "outbox message publish failed: tests.add",
    ]
