"""Relay metrics: a Protocol the relay calls, a no-op default, DogStatsd when configured.

Metric names, types and tags are listed in docs/reference-metrics.md; keep the two in step.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Protocol

import structlog

from outbox_notify.exceptions import ConfigurationError

log = structlog.get_logger("outbox_notify")

PUBLISHED = "outbox_notify.published"
FAILED = "outbox_notify.failed"
DEAD_LETTERED = "outbox_notify.dead_lettered"
DEFERRED = "outbox_notify.deferred"
BATCH_SIZE = "outbox_notify.batch.size"
BATCH_DURATION = "outbox_notify.batch.duration"
LAG = "outbox_notify.lag"
QUEUE_DEPTH = "outbox_notify.queue.depth"
QUEUE_OLDEST = "outbox_notify.queue.oldest_seconds"
DEAD_ROWS = "outbox_notify.table.dead_rows"
OLDEST_SNAPSHOT = "outbox_notify.table.oldest_snapshot_seconds"
DEAD_ROWS_HELD = "outbox_notify.table.dead_rows_held"
QUEUE_DUE = "outbox_notify.queue.due"
QUEUE_HELD = "outbox_notify.queue.held"
QUEUE_RETRYING = "outbox_notify.queue.retrying"
DEAD_LETTERS = "outbox_notify.dead_letters"
RELAYS_LISTENING = "outbox_notify.relays.listening"

OTHER_TASKS = "other"  # the task_name tag of every name past the cardinality cap
_UNSAFE_TAG_CHARS = re.compile(r"[^A-Za-z0-9_.:/\-]")
MAX_TAG_LENGTH = 200  # characters; DogStatsd tags are truncated by the agent anyway


class Metrics(Protocol):
    """What the relay reports. Every method must be cheap and must never raise."""

    def published(self, task_name: str, count: int = 1) -> None: ...
    def failed(self, task_name: str, count: int = 1) -> None: ...
    def dead_lettered(self, task_name: str, count: int = 1) -> None: ...
    def deferred(self, count: int) -> None: ...
    def batch(self, size: int, seconds: float) -> None: ...
    def lag(self, seconds: float) -> None: ...
    def queue(self, depth: int, oldest_seconds: float) -> None: ...
    # held_rows: the dead rows a vacuum had to leave (QueueGauges.dead_rows_held).
    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None: ...
    # dead_letters None: the relay's role may not count them (nothing is reported for it).
    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None: ...
    def relays(self, listening: int) -> None: ...


class NullMetrics:
    """Metrics off: every call does nothing."""

    def published(self, task_name: str, count: int = 1) -> None:
        return None

    def failed(self, task_name: str, count: int = 1) -> None:
        return None

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        return None

    def deferred(self, count: int) -> None:
        return None

    def batch(self, size: int, seconds: float) -> None:
        return None

    def lag(self, seconds: float) -> None:
        return None

    def queue(self, depth: int, oldest_seconds: float) -> None:
        return None

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        return None

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        return None

    def relays(self, listening: int) -> None:
        return None


class FanOut:
    """Several Metrics as one (StatsD and Prometheus both on): each call goes to every sink."""

    def __init__(self, *sinks: Metrics) -> None:
        self.sinks = sinks

    def published(self, task_name: str, count: int = 1) -> None:
        for sink in self.sinks:
            sink.published(task_name, count)

    def failed(self, task_name: str, count: int = 1) -> None:
        for sink in self.sinks:
            sink.failed(task_name, count)

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        for sink in self.sinks:
            sink.dead_lettered(task_name, count)

    def deferred(self, count: int) -> None:
        for sink in self.sinks:
            sink.deferred(count)

    def batch(self, size: int, seconds: float) -> None:
        for sink in self.sinks:
            sink.batch(size, seconds)

    def lag(self, seconds: float) -> None:
        for sink in self.sinks:
            sink.lag(seconds)

    def queue(self, depth: int, oldest_seconds: float) -> None:
        for sink in self.sinks:
            sink.queue(depth, oldest_seconds)

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        for sink in self.sinks:
            sink.vacuum(dead_rows, snapshot_seconds, held_rows)

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        for sink in self.sinks:
            sink.backlog(due, held, retrying, dead_letters)

    def relays(self, listening: int) -> None:
        for sink in self.sinks:
            sink.relays(listening)


def combined(*sinks: Metrics) -> Metrics:
    """One Metrics for these sinks: NullMetrics left out, FanOut only when two remain."""
    on = [sink for sink in sinks if not isinstance(sink, NullMetrics)]
    if not on:
        return NullMetrics()
    return on[0] if len(on) == 1 else FanOut(*on)


class TaskNameTags:
    """Bounds the task_name tag's cardinality: the first `limit` names, then OTHER_TASKS."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def value(self, task_name: str) -> str:
        """The task_name tag's (or label's) value for this name, sanitised and within the cap."""
        name = _UNSAFE_TAG_CHARS.sub("_", task_name)[:MAX_TAG_LENGTH] or "_"
        with self._lock:
            if name not in self._seen and len(self._seen) >= self.limit:
                name = OTHER_TASKS
            else:
                self._seen.add(name)
        return name

    def tag(self, task_name: str) -> str:
        """The `task_name:...` tag for this name, sanitised and within the cap."""
        return f"task_name:{self.value(task_name)}"


class DogStatsdMetrics:
    """Sends the relay's metrics through a `datadog.DogStatsd` client; never raises."""

    MAX_TASK_NAMES = 100  # distinct task_name tag values before the rest become OTHER_TASKS

    def __init__(self, client: Any, *, max_task_names: int | None = None) -> None:
        self.client = client
        self.tags = TaskNameTags(self.MAX_TASK_NAMES if max_task_names is None else max_task_names)

    def _send(self, kind: str, metric: str, value: float, tags: list[str] | None = None) -> None:
        """Call the client's `kind` method (increment, gauge...), swallowing any error."""
        try:
            getattr(self.client, kind)(metric, value, tags=tags)
        except Exception as exc:  # metrics must never break the relay
            log.debug("outbox.metrics_send_failed", metric=metric, error=repr(exc))

    def published(self, task_name: str, count: int = 1) -> None:
        self._send("increment", PUBLISHED, count, [self.tags.tag(task_name)])

    def failed(self, task_name: str, count: int = 1) -> None:
        self._send("increment", FAILED, count, [self.tags.tag(task_name)])

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        self._send("increment", DEAD_LETTERED, count, [self.tags.tag(task_name)])

    def deferred(self, count: int) -> None:
        self._send("increment", DEFERRED, count)

    def batch(self, size: int, seconds: float) -> None:
        self._send("histogram", BATCH_SIZE, size)
        self._send("distribution", BATCH_DURATION, seconds)

    def lag(self, seconds: float) -> None:
        self._send("distribution", LAG, seconds)

    def queue(self, depth: int, oldest_seconds: float) -> None:
        self._send("gauge", QUEUE_DEPTH, depth)
        self._send("gauge", QUEUE_OLDEST, oldest_seconds)

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        self._send("gauge", DEAD_ROWS, dead_rows)
        self._send("gauge", OLDEST_SNAPSHOT, snapshot_seconds)
        self._send("gauge", DEAD_ROWS_HELD, held_rows)

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        self._send("gauge", QUEUE_DUE, due)
        self._send("gauge", QUEUE_HELD, held)
        self._send("gauge", QUEUE_RETRYING, retrying)
        if dead_letters is not None:
            self._send("gauge", DEAD_LETTERS, dead_letters)

    def relays(self, listening: int) -> None:
        self._send("gauge", RELAYS_LISTENING, listening)

    def close(self) -> None:
        """Close the client's socket (on shutdown; a later metric call reopens it)."""
        try:
            self.client.close_socket()
        except Exception as exc:  # closing must not break a shutdown either
            log.debug("outbox.metrics_close_failed", error=repr(exc))


def dogstatsd_client(settings: dict[str, Any]) -> Any:
    """A DogStatsd client for conf.statsd()'s settings: unbuffered, no client telemetry."""
    from datadog.dogstatsd.base import DogStatsd

    return DogStatsd(
        host=settings["host"],
        port=settings["port"],
        namespace=settings["namespace"],
        constant_tags=settings["constant_tags"],
        disable_telemetry=True,
        disable_buffering=True,
    )


def from_settings() -> Metrics:
    """The metrics sink the settings ask for (NullMetrics unless OUTBOX_NOTIFY_STATSD_HOST)."""
    # Imported here: the rest of this module is the relay core's, which runs without Django.
    from outbox_notify import conf

    try:
        settings = conf.statsd()
    except (ConfigurationError, ValueError, TypeError) as exc:
        log.warning("outbox.metrics_disabled", reason="invalid StatsD settings", error=str(exc))
        return NullMetrics()
    if settings is None:
        return NullMetrics()
    try:
        client = dogstatsd_client(settings)
    except ImportError:
        log.warning(
            "outbox.metrics_disabled",
            reason="OUTBOX_NOTIFY_STATSD_HOST is set but the datadog package is not installed",
            hint="pip install 'outbox-notify[datadog]'",
        )
        return NullMetrics()
    return DogStatsdMetrics(client)
