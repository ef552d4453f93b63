"""The relay's metrics in Prometheus's text format, at /metrics, beside a /healthz probe.

`PrometheusMetrics` is the `Metrics` protocol (outbox_notify.metrics) on a registry of its
own, through the official `prometheus_client` (the `prometheus` extra), imported only when
built, so the package works without it. `serve()` answers /metrics and /healthz from a daemon
thread. Names follow Prometheus's conventions (`_total` counters, base units in the name) and
are listed in docs/reference-metrics.md; `stats_exposition()` writes the gauges of
`outbox_stats` in the same format without the extra (for a textfile collector).
"""

from __future__ import annotations

import dataclasses
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog

from outbox_notify.exceptions import ConfigurationError
from outbox_notify.metrics import TaskNameTags

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

log = structlog.get_logger("outbox_notify")

PREFIX = "outbox_notify_"
# Bucket bounds, in their metric's unit: from a wake-up on NOTIFY (milliseconds) to a
# message that waited out a broker outage or an ETA held for an hour.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SIZE_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000)  # rows

# Every metric the relay's endpoint serves: name -> (type, help). The docs' dashboard and
# alert rules may use these names only (tests/unit/test_metrics_prometheus.py holds them).
RELAY_METRICS: dict[str, tuple[str, str]] = {
    "published_total": ("counter", "Messages published, by task name"),
    "failed_total": (
        "counter",
        "Publishes that failed while the broker was reachable; a retry was scheduled",
    ),
    "dead_lettered_total": ("counter", "Messages moved to the dead letters, by task name"),
    "deferred_total": ("counter", "Messages put back for a broker outage (no retry spent)"),
    "batch_size_rows": ("histogram", "Rows claimed by one batch"),
    "batch_duration_seconds": ("histogram", "Seconds from a batch's claim to its commit"),
    "lag_seconds": (
        "histogram",
        "Seconds from a published row's write (or held ETA) to the commit that deleted it",
    ),
    "queue_depth_rows": ("gauge", "Outbox rows pending (retrying and held included)"),
    "queue_oldest_seconds": ("gauge", "Age of the oldest pending row"),
    "table_dead_rows": ("gauge", "Dead rows in the outbox table, not yet vacuumed"),
    "table_oldest_snapshot_seconds": (
        "gauge",
        "Age of the oldest snapshot keeping vacuum from the outbox's dead rows",
    ),
    "table_dead_rows_held": (
        "gauge",
        "Dead rows in the outbox table a vacuum had to leave (a snapshot holds them)",
    ),
    "queue_due_rows": ("gauge", "Outbox rows due now (not waiting for a retry or an ETA)"),
    "queue_held_rows": ("gauge", "Outbox rows held until an ETA still ahead"),
    "queue_retrying_rows": ("gauge", "Outbox rows waiting for a retry"),
    "dead_letters_rows": ("gauge", "Rows in the dead-letter table"),
    "relays_listening": ("gauge", "Relay sessions waiting on LISTEN"),
    "relay_connected": ("gauge", "1 while this relay is connected to PostgreSQL, else 0"),
    "relay_listening": ("gauge", "1 while this relay waits on LISTEN, 0 polling or disconnected"),
}

# The gauges `outbox_stats --format prometheus` writes: name -> (help, OutboxStats attribute).
STATS_GAUGES: dict[str, tuple[str, str]] = {
    "queue_depth_rows": ("Outbox rows pending (retrying and held included)", "queue_depth"),
    "queue_due_rows": ("Outbox rows due now (not waiting for a retry or an ETA)", "due_now"),
    "queue_held_rows": ("Outbox rows held until an ETA still ahead", "held"),
    "queue_retrying_rows": ("Outbox rows waiting for a retry", "retrying"),
    "dead_letters_rows": ("Rows in the dead-letter table", "dead_letter_count"),
    "queue_oldest_seconds": ("Age of the oldest pending row", "oldest_pending_seconds"),
    "relays_listening": ("Relay sessions waiting on LISTEN", "relays_listening"),
    "claims_open": ("Relay transactions holding a claimed batch", "claims_open"),
    "notify_queue_usage_ratio": ("Fraction of PostgreSQL's NOTIFY queue in use", "notify_usage"),
    "table_dead_rows": ("Dead rows in the outbox table, not yet vacuumed", "dead_rows"),
    "table_dead_rows_held": (
        "Dead rows in the outbox table a vacuum had to leave (a snapshot holds them)",
        "dead_rows_held",
    ),
}


class RelayState(Protocol):
    """What /healthz and the relay gauges read (outbox_notify.relay.loop.Relay has both)."""

    @property
    def connected(self) -> bool: ...

    @property
    def polling(self) -> bool: ...


def _client() -> Any:
    """The prometheus_client module, or a ConfigurationError saying which extra brings it."""
    try:
        import prometheus_client
        import prometheus_client.core  # GaugeMetricFamily, for the relay's state
    except ImportError as exc:
        raise ConfigurationError(
            "the Prometheus endpoint needs prometheus_client: "
            "pip install 'outbox-notify[prometheus]'"
        ) from exc
    return prometheus_client


class PrometheusMetrics:
    """The relay's Metrics as Prometheus counters, histograms and gauges; never raises."""

    MAX_TASK_NAMES = 100  # distinct task_name label values before the rest become "other"

    def __init__(self, *, max_task_names: int | None = None) -> None:
        client = _client()
        self.registry = client.CollectorRegistry(auto_describe=True)
        self.names = TaskNameTags(self.MAX_TASK_NAMES if max_task_names is None else max_task_names)
        self.state: RelayState | None = None
        r = self.registry

        def help_of(name: str) -> str:
            return RELAY_METRICS[name][1]

        def counter(name: str, *labels: str) -> Any:
            # prometheus_client appends _total to a counter's name itself.
            base = name.removesuffix("_total")
            return client.Counter(PREFIX + base, help_of(name), labels, registry=r)

        def histogram(name: str, buckets: tuple[float, ...]) -> Any:
            return client.Histogram(PREFIX + name, help_of(name), buckets=buckets, registry=r)

        def gauge(name: str) -> Any:
            return client.Gauge(PREFIX + name, help_of(name), registry=r)

        self._published = counter("published_total", "task_name")
        self._failed = counter("failed_total", "task_name")
        self._dead = counter("dead_lettered_total", "task_name")
        self._deferred = counter("deferred_total")
        self._size = histogram("batch_size_rows", SIZE_BUCKETS)
        self._duration = histogram("batch_duration_seconds", DURATION_BUCKETS)
        self._lag = histogram("lag_seconds", LAG_BUCKETS)
        self._depth = gauge("queue_depth_rows")
        self._oldest = gauge("queue_oldest_seconds")
        self._dead_rows = gauge("table_dead_rows")
        self._snapshot = gauge("table_oldest_snapshot_seconds")
        self._dead_rows_held = gauge("table_dead_rows_held")
        # Absent until the relay first read them (and dead letters while its role may not
        # count them), rather than a 0 an alert would take for the truth.
        self._last = _LastValues(client)
        self.registry.register(self._last)
        self.registry.register(_StateCollector(self, client))

    def published(self, task_name: str, count: int = 1) -> None:
        self._published.labels(self.names.value(task_name)).inc(count)

    def failed(self, task_name: str, count: int = 1) -> None:
        self._failed.labels(self.names.value(task_name)).inc(count)

    def dead_lettered(self, task_name: str, count: int = 1) -> None:
        self._dead.labels(self.names.value(task_name)).inc(count)

    def deferred(self, count: int) -> None:
        self._deferred.inc(count)

    def batch(self, size: int, seconds: float) -> None:
        self._size.observe(size)
        self._duration.observe(seconds)

    def lag(self, seconds: float) -> None:
        self._lag.observe(seconds)

    def queue(self, depth: int, oldest_seconds: float) -> None:
        self._depth.set(depth)
        self._oldest.set(oldest_seconds)

    def vacuum(self, dead_rows: int, snapshot_seconds: float, held_rows: int) -> None:
        self._dead_rows.set(dead_rows)
        self._snapshot.set(snapshot_seconds)
        self._dead_rows_held.set(held_rows)

    def backlog(self, due: int, held: int, retrying: int, dead_letters: int | None) -> None:
        self._last.set("queue_due_rows", due)
        self._last.set("queue_held_rows", held)
        self._last.set("queue_retrying_rows", retrying)
        if dead_letters is not None:
            self._last.set("dead_letters_rows", dead_letters)

    def relays(self, listening: int) -> None:
        self._last.set("relays_listening", listening)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format (what /metrics answers)."""
        return bytes(_client().generate_latest(self.registry))


class _LastValues:
    """Gauges served from the last value the relay set, and not at all before one."""

    NAMES = (
        "queue_due_rows",
        "queue_held_rows",
        "queue_retrying_rows",
        "dead_letters_rows",
        "relays_listening",
    )

    def __init__(self, client: Any) -> None:
        self.family = client.core.GaugeMetricFamily
        self.values: dict[str, float] = {}
        self.lock = threading.Lock()

    def set(self, name: str, value: float) -> None:
        with self.lock:
            self.values[name] = float(value)

    def describe(self) -> Iterator[Any]:
        # Every family, known or not yet: the registry checks names against it once.
        for name in self.NAMES:
            yield self.family(PREFIX + name, RELAY_METRICS[name][1])

    def collect(self) -> Iterator[Any]:
        with self.lock:
            known = dict(self.values)
        for name in self.NAMES:
            if name in known:
                yield self.family(PREFIX + name, RELAY_METRICS[name][1], value=known[name])


class _StateCollector:
    """relay_connected and relay_listening, read from the relay when scraped."""

    def __init__(self, owner: PrometheusMetrics, client: Any) -> None:
        self.owner = owner
        self.family = client.core.GaugeMetricFamily

    def collect(self) -> Iterator[Any]:
        connected, listening = health(self.owner.state)
        for name, value in (("relay_connected", connected), ("relay_listening", listening)):
            yield self.family(PREFIX + name, RELAY_METRICS[name][1], value=float(value))


def health(state: RelayState | None) -> tuple[bool, bool]:
    """(connected, listening) of a relay; both False before there is one."""
    if state is None or not state.connected:
        return False, False
    return True, not state.polling


def healthz(state: RelayState | None) -> tuple[str, bytes]:
    """/healthz's status line and body: 200 connected (listening or polling), else 503."""
    connected, listening = health(state)
    if not connected:
        return "503 Service Unavailable", b"disconnected\n"
    return "200 OK", b"listening\n" if listening else b"polling\n"


def wsgi_app(metrics: PrometheusMetrics) -> Callable[..., Iterable[bytes]]:
    """/metrics from the registry, /healthz from the relay's state, 404 for anything else."""
    serve_metrics = _client().make_wsgi_app(metrics.registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return serve_metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            status, body = healthz(metrics.state)
        else:
            status, body = "404 Not Found", b"not found: try /metrics or /healthz\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request: a scrape every 15 s would fill the relay's log."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the relay's exit


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Endpoint:
    """A running /metrics and /healthz server; close() stops it."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()


def serve(metrics: PrometheusMetrics, address: str, port: int) -> Endpoint:
    """Serve /metrics and /healthz on address:port (0: any free port) from a daemon thread."""
    server_class = _ThreadingServer6 if ":" in address else _ThreadingServer
    try:
        server = make_server(
            address, port, wsgi_app(metrics), server_class=server_class, handler_class=_QuietHandler
        )
    except (OSError, OverflowError) as exc:
        raise ConfigurationError(f"cannot serve metrics on {address}:{port}: {exc}") from exc
    thread = threading.Thread(
        target=server.serve_forever, name="outbox-notify-metrics", daemon=True
    )
    thread.start()
    endpoint = Endpoint(server=server, thread=thread)
    log.info("outbox.metrics_serving", address=address, port=endpoint.port)
    return endpoint


def stats_exposition(snapshot: Any) -> str:
    """outbox_stats's gauges in Prometheus's text format (for node_exporter's textfile
    collector); written by hand so a cron-only install needs no extra.

    `snapshot`: an outbox_notify.stats.OutboxStats (not imported: stats is a layer above).
    """
    values = {
        "held": snapshot.scheduled.count,
        "notify_usage": snapshot.notify_queue_usage,
    }
    lines: list[str] = []
    for name, (text, attribute) in STATS_GAUGES.items():
        value = values[attribute] if attribute in values else getattr(snapshot, attribute)
        lines += [
            f"# HELP {PREFIX}{name} {text}",
            f"# TYPE {PREFIX}{name} gauge",
            f"{PREFIX}{name} {float(value)!r}",
        ]
    return "\n".join(lines) + "\n"
