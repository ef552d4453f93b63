"""The relay's OpenTelemetry side: spans and metrics, when the application configured them.

Nothing here is on unless the OpenTelemetry API is installed (the `otel` extra) and the
process set a tracer provider (spans: relay/tracing.py) or a meter provider (OTelMetrics) by
the time the relay is built, as `opentelemetry-instrument` or the settings module does. The
relay core (loop, store, publisher) never imports OpenTelemetry: runner.py wraps its seams.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from outbox_notify import metrics as names
from outbox_notify.metrics import Metrics, TaskNameTags
from outbox_notify.relay.publisher import Publisher
from outbox_notify.relay.store import Store

INSTRUMENTATION = "outbox_notify"  # the tracer's and the meter's name
TASK_NAME = "task_name"  # attribute of the per-task counters


def _configured(provider: object, api_package: str) -> bool:
    # The API's own providers (the proxy it hands out until one is set, and the no-op one)
    # are defined in the API package; every real one (the SDK's, a vendor's) elsewhere.
    return not type(provider).__module__.startswith(api_package)


def tracer() -> Any | None:
    """The relay's Tracer when a tracer provider is configured; None otherwise."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    provider = trace.get_tracer_provider()
    if not _configured(provider, "opentelemetry.trace"):
        return None
    return provider.get_tracer(INSTRUMENTATION)


def meter() -> Any | None:
    """The relay's Meter when a meter provider is configured; None otherwise."""
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    provider = metrics.get_meter_provider()
    if not _configured(provider, "opentelemetry.metrics"):
        return None
    return provider.get_meter(INSTRUMENTATION)


class Tracing:
    """Wraps the relay's seams in spans when a tracer is given; hands them back as they are
    without one."""

    def __init__(self, tracer: Any | None, *, system: str = "") -> None:
        self.tracer = tracer
        self.system = system

    def store(self, store: Store) -> Store:
        """The store, its claims traced."""
        if self.tracer is None:
            return store
        from outbox_notify.relay.tracing import TracingStore

        return TracingStore(store, self.tracer)

    def publisher(self, publisher: Publisher) -> Publisher:
        """The publisher, its batches traced."""
        if self.tracer is None:
            return publisher
        from outbox_notify.relay.tracing import TracingPublisher

        return TracingPublisher(publisher, self.tracer, system=self.system)


def with_meter(sink: Metrics, given: Any | None = None) -> Metrics:
    """`sink`, plus OTelMetrics when a meter provider is configured (or a meter is `given`)."""
    found = given if given is not None else meter()
    if found is None:
        return sink
    return Fanout([sink, OTelMetrics(found)])


class OTelMetrics:
    """The relay's metrics (docs/reference-metrics.md) as OpenTelemetry instruments: counters,
    histograms, and gauges observed at each collection from the last sampled value."""

    MAX_TASK_NAMES = 100  # distinct task_name values before the rest become "other"

    def __init__(self, meter: Any) -> None:
        self.tags = TaskNameTags(self.MAX_TASK_NAMES)
        count, seconds = "{message}", "s"
        self._published = meter.create_counter(names.PUBLISHED, unit=count)
        self._failed = meter.create_counter(names.FAILED, unit=count)
        self._dead = meter.create_counter(names.DEAD_LETTERED, unit=count)
        self._deferred = meter.create_counter(names.DEFERRED, unit=count)
        self._batch_size = meter.create_histogram(names.BATCH_SIZE, unit=count)
        self._batch_duration = meter.create_histogram(names.BATCH_DURATION, unit=seconds)
        self._lag = meter.create_histogram(names.LAG, unit=seconds)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        for name, unit in (
            (names.QUEUE_DEPTH, count),
            (names.QUEUE_OLDEST, seconds),
            (names.DEAD_ROWS, "{row}"),
            (names.OLDEST_SNAPSHOT, seconds),
            (names.DEAD_ROWS_HELD, "{row}"),
            (names.QUEUE_DUE, count),
            (names.QUEUE_HELD, count),
            (names.QUEUE_RETRYING, count),
            (names.DEAD_LETTERS, count),
            (names.RELAYS_LISTENING, "{relay}"),
        ):
            meter.create_observable_gauge(name, callbacks=[self._observer(name)], unit=unit)

    def _observer(self, name: str) -> Callable[[Any], Iterable[Any]]:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterable[Any]:
            with self._lock:
                value = self._last.get(name)
            return [] if value is None else [Observation(value)]

        return observe

    def _task(self, task_name: str) -> dict[str, str]:
        return {TASK_NAME: self.tags.tag(task_name).partition(":")[2]}

    def published(self, task_name: str, count: int = 1) -> None:
        self._published.add(count, self._task(task_name))

    def failed(self, task_name: str, count: int = 1) -> None:
        self._failed.add(count, self._task(task_name))

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        self._dead.add(count, self._task(task_name))

    def deferred(self, count: int) -> None:
        self._deferred.add(count)

    def batch(self, size: int, seconds: float) -> None:
        self._batch_size.record(size)
        self._batch_duration.record(seconds)

    def lag(self, seconds: float) -> None:
        self._lag.record(seconds)

    def queue(self, depth: int, oldest_seconds: float) -> None:
        with self._lock:
            self._last[names.QUEUE_DEPTH] = depth
            self._last[names.QUEUE_OLDEST] = oldest_seconds

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        with self._lock:
            self._last[names.DEAD_ROWS] = dead_rows
            self._last[names.OLDEST_SNAPSHOT] = snapshot_seconds
            self._last[names.DEAD_ROWS_HELD] = held_rows

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        with self._lock:
            self._last[names.QUEUE_DUE] = due
            self._last[names.QUEUE_HELD] = held
            self._last[names.QUEUE_RETRYING] = retrying
            if dead_letters is not None:
                self._last[names.DEAD_LETTERS] = dead_letters

    def relays(self, listening: int) -> None:
        with self._lock:
            self._last[names.RELAYS_LISTENING] = listening


class Fanout:
    """Several Metrics as one; a sink that raises stops no other (the Protocol forbids raising,
    but a third-party exporter is not ours to trust)."""

    def __init__(self, sinks: Sequence[Metrics]) -> None:
        self.sinks = tuple(sinks)

    def _each(self, method: str, *args: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # metrics must never break the relay
                names.log.debug("outbox.metrics_send_failed", metric=method, error=repr(exc))

    def published(self, task_name: str, count: int = 1) -> None:
        self._each("published", task_name, count)

    def failed(self, task_name: str, count: int = 1) -> None:
        self._each("failed", task_name, count)

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        self._each("dead_lettered", task_name, count)

    def deferred(self, count: int) -> None:
        self._each("deferred", count)

    def batch(self, size: int, seconds: float) -> None:
        self._each("batch", size, seconds)

    def lag(self, seconds: float) -> None:
        self._each("lag", seconds)

    def queue(self, depth: int, oldest_seconds: float) -> None:
        self._each("queue", depth, oldest_seconds)

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        self._each("vacuum", dead_rows, snapshot_seconds, held_rows)

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        self._each("backlog", due, held, retrying, dead_letters)

    def relays(self, listening: int) -> None:
        self._each("relays", listening)
