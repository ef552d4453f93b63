"""The enqueuing span's W3C headers survive the stored row, beside Sentry's trace headers."""

from __future__ import annotations

from typing import Any

import pytest
import sentry_sdk
from django.db import transaction
from opentelemetry.sdk.trace import TracerProvider

from tests.celery_app import add
from tests.integration.test_tracing import MemoryTransport, sentry  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("repeat", [1, 3])  # the third call of a shape takes the template path
def test_traceparent_travels_from_the_enqueue_to_the_message(
    drain_outbox: Any, repeat: int
) -> None:
    """Every message written inside a span carries that span as its traceparent header."""
    tracer = TracerProvider().get_tracer("tests")
    with tracer.start_as_current_span("request") as span, transaction.atomic():
        for n in range(repeat):
            add.delay(n, 1)
    ids = f"{span.get_span_context().trace_id:032x}-{span.get_span_context().span_id:016x}"
    published = drain_outbox()
    assert [m.headers["traceparent"][3:-3] for m in published] == [ids] * repeat


def test_sentry_and_opentelemetry_headers_travel_together(
    sentry: MemoryTransport,  # noqa: F811
    drain_outbox: Any,
) -> None:
    """With both tracers active, the message has both sentry-trace and traceparent."""
    tracer = TracerProvider().get_tracer("tests")
    with (
        sentry_sdk.start_transaction(name="checkout") as sentry_span,
        tracer.start_as_current_span("request") as span,
        transaction.atomic(),
    ):
        add.delay(1, 2)
    [message] = drain_outbox()
    assert message.headers["sentry-trace"].startswith(sentry_span.trace_id)
    assert f"{span.get_span_context().trace_id:032x}" in message.headers["traceparent"]
