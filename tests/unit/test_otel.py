"""OpenTelemetry: the trace context captured at enqueue, the relay's spans and its metrics.

Every test uses an SDK provider of its own (in-memory exporters); the global providers stay
unset, as in a process that never configured OpenTelemetry.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox_notify import metrics, otel
from outbox_notify._write import context
from outbox_notify.fakes import InMemoryStore, RecordingMetrics, claimed_row, publishes_all
from outbox_notify.relay import messages
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.relay.tracing import link_to


def _tracing() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tests"), exporter


def _ids(span_context: Any) -> tuple[int, int]:
    return span_context.trace_id, span_context.span_id


def _row(n: int, carrier: dict[str, str]) -> ClaimedRow:
    return dataclasses.replace(claimed_row(n), context=json.dumps({"otel": carrier}))


def test_nothing_is_captured_without_a_current_span() -> None:
    """No span current: no trace headers (and so no bytes added to the row)."""
    assert context.otel_context() == {}
    assert "otel" not in context.capture(frozenset())


def test_the_current_span_round_trips_through_the_stored_context_to_the_headers() -> None:
    """Captured as W3C traceparent at enqueue, it reaches the message headers at publish, and
    extracting those headers gives the enqueuing span's context back."""
    tracer, _ = _tracing()
    with tracer.start_as_current_span("request") as span:
        captured = context.capture(frozenset())
    expected = span.get_span_context()
    traceparent = captured["otel"]["traceparent"]
    ids = f"{expected.trace_id:032x}-{expected.span_id:016x}"
    assert traceparent == f"00-{ids}-{expected.trace_flags:02x}"
    row = dataclasses.replace(claimed_row(1), context=json.dumps(captured))
    message = messages.prepare(row, row.created_at)
    assert message.headers["traceparent"] == traceparent
    link = link_to(message.headers)
    assert link is not None
    assert _ids(link.context) == _ids(expected)


def test_a_trace_header_the_message_already_has_is_kept() -> None:
    """A traceparent set by the call (or by Celery's instrumentation at send) wins."""
    options = json.loads(claimed_row(1).options)
    options.setdefault("headers", {})["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    row = dataclasses.replace(
        claimed_row(1),
        options=json.dumps(options),
        context=json.dumps({"otel": {"traceparent": "00-" + "3" * 32 + "-" + "4" * 16 + "-01"}}),
    )
    assert messages.prepare(row, row.created_at).headers["traceparent"].startswith("00-111")


def test_relay_spans_link_to_each_message_and_are_nobodys_child() -> None:
    """outbox.claim and outbox.publish: roots of their own, one link per message's span."""
    tracer, exporter = _tracing()
    with tracer.start_as_current_span("one") as one, tracer.start_as_current_span("two") as two:
        first = context.otel_context()
    with tracer.start_as_current_span("other") as other:
        second = context.otel_context()
    tracing = otel.Tracing(tracer)
    store = InMemoryStore([_row(1, first), _row(2, second)])
    publisher = publishes_all()
    relay = Relay(
        RelayConfig(),
        store=tracing.store(store),
        listener=None,
        publisher=tracing.publisher(publisher),
    )
    with tracer.start_as_current_span("unrelated"):  # current while the relay works
        relay.process_batch()
    assert [m.row.id for m in publisher.messages] == [1, 2]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    expected = [_ids(two.get_span_context()), _ids(other.get_span_context())]
    assert _ids(one.get_span_context()) not in expected  # the innermost span is the current one
    for name in ("outbox.claim", "outbox.publish"):
        span = spans[name]
        assert span.parent is None
        assert [_ids(link.context) for link in span.links] == expected
        assert span.attributes is not None
        assert span.attributes["messaging.batch.message_count"] == 2
    assert spans["outbox.publish"].attributes["outbox.published"] == 2  # type: ignore[index]


def test_no_spans_without_a_tracer() -> None:
    """Tracing(None) hands the seams back untouched (what runner does with no provider)."""
    store, publisher = InMemoryStore(), publishes_all()
    tracing = otel.Tracing(None)
    assert tracing.store(store) is store
    assert tracing.publisher(publisher) is publisher
    assert otel.tracer() is None
    assert otel.meter() is None


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = list(metric.data.data_points)
    return found


def test_the_relay_metrics_reach_an_opentelemetry_meter() -> None:
    """Counters per task name, histograms, and gauges observed from the last sample; the
    StatsD sink beside it still hears every call."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("tests")
    beside = RecordingMetrics()
    sink = otel.with_meter(beside, meter)
    sink.published("tasks.a", 3)
    sink.published("tasks.a")
    sink.failed("tasks.b")
    sink.batch(4, 0.25)
    sink.lag(1.5)
    sink.queue(7, 12.0)
    points = _points(reader)
    [published] = points[metrics.PUBLISHED]
    assert (published.value, dict(published.attributes)) == (4, {"task_name": "tasks.a"})
    assert points[metrics.BATCH_DURATION][0].sum == 0.25
    assert points[metrics.QUEUE_DEPTH][0].value == 7
    assert metrics.DEAD_ROWS not in points  # never sampled: nothing observed
    assert [name for name, _ in beside.calls] == [
        "published", "published", "failed", "batch", "lag", "queue",
    ]  # fmt: skip


def test_a_sink_that_raises_stops_no_other() -> None:
    """Fanout swallows one sink's error and still calls the next."""

    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("exporter down")

    recorder = RecordingMetrics()
    otel.Fanout([Broken(), recorder]).deferred(2)  # type: ignore[list-item]
    assert recorder.calls == [("deferred", (2,))]


def test_the_global_providers_stay_unset() -> None:
    """These tests configure no global provider (other tests' relays must not trace)."""
    assert type(trace.get_tracer_provider()).__module__.startswith("opentelemetry.trace")
