"""OpenTelemetry set-up the otel tests give their relay and worker subprocesses.

Each process exports what it records to a JSON-lines file of its own, which the test reads:
spans (name, ids, parent, links) and metric names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

METRIC_INTERVAL = 500  # milliseconds between metric exports


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """What a test needs of a span: its ids, its parent's and its links' (hex, as W3C has them)."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "trace_id": _hex(context.trace_id, 32),
        "span_id": _hex(context.span_id, 16),
        "parent": _hex(span.parent.span_id, 16) if span.parent else None,
        "links": [
            {"trace_id": _hex(link.context.trace_id, 32), "span_id": _hex(link.context.span_id, 16)}
            for link in span.links
        ],
        "attributes": dict(span.attributes or {}),
    }


class FileSpanExporter(SpanExporter):
    """Appends each finished span to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as handle:
            for span in spans:
                handle.write(json.dumps(span_record(span), default=str) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class FileMetricExporter(MetricExporter):
    """Appends the names of the metrics of each export to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        found = [
            metric.name
            for resource in metrics_data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        ]
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(found) + "\n")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


def install_from_env() -> None:
    """Global providers exporting to OUTBOX_TEST_SPAN_FILE / OUTBOX_TEST_METRIC_FILE (if set)."""
    span_file = os.environ.get("OUTBOX_TEST_SPAN_FILE")
    if span_file:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(span_file)))
        trace.set_tracer_provider(provider)
    metric_file = os.environ.get("OUTBOX_TEST_METRIC_FILE")
    if metric_file:
        reader = PeriodicExportingMetricReader(
            FileMetricExporter(metric_file), export_interval_millis=METRIC_INTERVAL
        )
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))


def read_lines(path: Path) -> list[Any]:
    """The JSON lines a subprocess wrote so far ([] before the first)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
