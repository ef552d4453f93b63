"""One trace from the enqueuing span to the worker's span, across the outbox and its relay.

The test process enqueues inside a span (an SDK tracer of its own, not the global one); a real
relay (`outbox_listen` on Redis, its providers set by tests.otel_settings) and a real Celery
worker instrumented with CeleryInstrumentor export their spans to files the test reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from tests.celery_app import record
from tests.otel_support import read_lines
from tests.relay_support import WorkerProcess, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]
# transaction=True: the relay and the worker are other processes; only commits reach them.

FAST = ["--sweep-interval", "1"]
WORKER_SPAN = "run/tests.record"  # what CeleryInstrumentor names a task's execution


@pytest.fixture
def tracer() -> Tracer:
    """A tracer of this test's own: the global provider stays unset for the other tests."""
    return TracerProvider().get_tracer("tests.otel")


@pytest.fixture
def traced(
    relay_env: dict[str, Any], start_relay: Any, queue_name: str, tmp_path: Path
) -> Iterator[dict[str, Path]]:
    """A traced relay and a traced worker on this test's queue; the files of their spans."""
    files = {
        "relay": tmp_path / "relay-spans.jsonl",
        "metrics": tmp_path / "relay-metrics.jsonl",
        "worker": tmp_path / "worker-spans.jsonl",
    }
    relay = dict(relay_env, DJANGO_SETTINGS_MODULE="tests.otel_settings")
    relay |= {"OUTBOX_TEST_SPAN_FILE": str(files["relay"])}
    relay |= {"OUTBOX_TEST_METRIC_FILE": str(files["metrics"])}
    start_relay(*FAST, env=relay)
    worker_env = dict(relay_env, OUTBOX_TEST_SPAN_FILE=str(files["worker"]))
    worker_env["OUTBOX_TEST_RECORD_FILE"] = str(tmp_path / "executions.jsonl")
    worker = WorkerProcess("tests.otel_worker", queue_name, worker_env, tmp_path / "worker.log")
    try:
        yield files
    finally:
        worker.stop()


def _ids(span: Any) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def _worker_span(path: Path, trace_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        spans = [s for s in read_lines(path) if s["name"] == WORKER_SPAN]
        return next((s for s in spans if s["trace_id"] == trace_id), None)

    span: dict[str, Any] = wait_for(found, what=f"the worker's span in trace {trace_id}")
    return span


def _linked(path: Path, name: str, trace_id: str, span_id: str) -> list[dict[str, Any]]:
    link = {"trace_id": trace_id, "span_id": span_id}
    return [s for s in read_lines(path) if s["name"] == name and link in s["links"]]


def test_the_worker_continues_the_enqueuing_trace(
    traced: dict[str, Path], tracer: Tracer, queue_name: str
) -> None:
    """The worker's task span is a child of the span current at enqueue (same trace id); the
    relay's claim and publish spans link to that span and are nobody's child."""
    with tracer.start_as_current_span("checkout") as span, transaction.atomic():
        record.apply_async(("otel-now",), queue=queue_name)
    trace_id, span_id = _ids(span)
    worker_span = _worker_span(traced["worker"], trace_id)
    print(f"\nenqueued in trace {trace_id} (span {span_id}); worker span {WORKER_SPAN!r} "
          f"in trace {worker_span['trace_id']}, parent {worker_span['parent']}")  # fmt: skip
    assert (worker_span["trace_id"], worker_span["parent"]) == (trace_id, span_id)
    for name in ("outbox.claim", "outbox.publish"):
        relay_spans = wait_for(
            lambda name=name: _linked(traced["relay"], name, trace_id, span_id), what=name
        )
        assert all(s["parent"] is None and s["trace_id"] != trace_id for s in relay_spans)
    wait_for(
        lambda: any("outbox_notify.published" in names for names in read_lines(traced["metrics"])),
        what="the relay's published counter exported through the OpenTelemetry meter",
    )


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=1)
def test_a_held_eta_still_continues_the_enqueuing_trace(
    traced: dict[str, Path], tracer: Tracer, queue_name: str
) -> None:
    """A task held in the outbox until its ETA (published later, by the sweep) reaches the
    worker in the trace that enqueued it."""
    with tracer.start_as_current_span("schedule") as span, transaction.atomic():
        record.apply_async(("otel-held",), countdown=3, queue=queue_name)
    trace_id, span_id = _ids(span)
    worker_span = _worker_span(traced["worker"], trace_id)
    print(f"\nheld: enqueued in trace {trace_id}; worker span in trace {worker_span['trace_id']}")
    assert (worker_span["trace_id"], worker_span["parent"]) == (trace_id, span_id)
