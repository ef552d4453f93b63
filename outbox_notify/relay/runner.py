"""Builds a relay from Django settings and command-line options; used by the commands.

The only place where the relay core meets Django: it reads the settings, turns the outbox
alias into connection parameters, and hands the core its seams (a Store, a WakeChannel, a
Publisher, Metrics and Reporters) ready-made.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Sequence
from typing import Any

from outbox_notify import conf, metrics, metrics_prometheus, observability, otel, queues, transport
from outbox_notify.exceptions import BrokerUnavailable, DatabaseUnavailable, OutboxNotifyError
from outbox_notify.index_keeper import IndexKeeper
from outbox_notify.relay.broker import publisher_for
from outbox_notify.relay.chords import ChordPublisher
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.listener import Listener
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.publisher import overlaps
from outbox_notify.relay.reporting import Reporter
from outbox_notify.relay.sent_events import SentEventPublisher
from outbox_notify.relay.store import ClaimStore, Preparing

# Keywords of Django's connection parameters that psycopg.connect() does not take.
_DJANGO_ONLY_PARAMS = ("cursor_factory", "context", "server_side_binding", "pool")


def connection_kwargs(alias: str) -> dict[str, Any]:
    """psycopg.connect() keywords for a Django alias (Django's own adapters removed)."""
    from django.db import connections

    params = dict(connections[alias].get_connection_params())
    for django_only in _DJANGO_ONLY_PARAMS:
        params.pop(django_only, None)
    return params


def prepare_left_to_us(alias: str) -> bool:
    """Whether the alias's OPTIONS leave psycopg's prepared statements to the relay.

    Django turns them off unless OPTIONS names `prepare_threshold`; a value given there, None
    included, is the user's word for every connection built from the alias.
    """
    from django.db import connections

    options = connections[alias].settings_dict.get("OPTIONS") or {}
    return "prepare_threshold" not in options


def reporters() -> list[Reporter]:
    """Who hears about committed batches besides metrics: Django signals, then Sentry."""
    return [observability.SignalReporter(), observability.SentryReporter()]


def build_relay(
    config: RelayConfig,
    *,
    listen: bool,
    wake_fd: int | None,
    extra_reporters: Sequence[Reporter] = (),
    extra_metrics: metrics.Metrics | None = None,
) -> Relay:
    """A relay wired to the outbox alias, the configured Celery app, metrics and reporters."""
    app = conf.celery_app()
    transport.require(app)  # kombu would raise a bare KeyError or ImportError further down
    queues.use_app(app)  # rows name the queues this app's configuration declares
    alias = conf.database_alias()
    params = connection_kwargs(alias)
    frontier = Frontier()  # where claims start; shared by every connection of this relay
    listen_dsn = conf.listen_dsn()
    ours = prepare_left_to_us(alias)
    listener = None
    if listen:
        listen_params: dict[str, Any] | str = listen_dsn or params
        listener = Listener(
            listen_params,
            lock_wait=config.lock_wait,
            wake_fd=wake_fd,
            stale_timeout=config.stale_timeout,
            frontier=frontier,
            # A LISTEN DSN is a session of its own by definition (docs/deploy.md).
            auto_prepare=ours or listen_dsn is not None,
        )
    # The claims prove to be a session of their own only when the LISTEN connection is built
    # from the same parameters: with a LISTEN DSN they may go through a transaction pooler.
    preparing = Preparing(allowed=ours and listen_dsn is None)
    tracing = otel.Tracing(otel.tracer())  # spans only when a tracer provider is configured
    broker = publisher_for(app, send_timeout=config.send_timeout)
    # A publisher with two batches in flight (RabbitMQ) claims the next one on a second claim
    # connection while the broker confirms the previous one.
    spare = None
    if overlaps(broker):
        spare = tracing.store(
            ClaimStore(
                params,
                stale_timeout=config.stale_timeout,
                frontier=frontier,
                preparing=preparing,
            )
        )
    store = ClaimStore(
        params, stale_timeout=config.stale_timeout, frontier=frontier, preparing=preparing
    )
    return Relay(
        config,
        store=tracing.store(store),
        spare_store=spare,
        samples=store,
        listener=listener,
        publisher=tracing.publisher(
            ChordPublisher(SentEventPublisher(broker, app, send_timeout=config.send_timeout), app)
        ),
        metrics=otel.with_meter(
            metrics.combined(metrics.from_settings(), extra_metrics or metrics.NullMetrics())
        ),
        reporters=[*reporters(), *extra_reporters],
    )


@contextlib.contextmanager
def index_keeper(relay: Relay) -> Iterator[IndexKeeper | None]:
    """The relay's index keeper (outbox_notify/index_keeper.py), running while the block runs.

    None when OUTBOX_NOTIFY_AUTO_REINDEX is off, with --poll-only, or with a LISTEN DSN (the
    alias then goes through a transaction pooler); otherwise it looks only while the relay's
    LISTEN probe has proven the alias's connections sessions of their own (not polling).
    """
    if not conf.auto_reindex() or relay.config.poll_only or conf.listen_dsn() is not None:
        yield None
        return
    keeper = IndexKeeper(
        connection_kwargs(conf.database_alias()),
        session=lambda: relay.connected and not relay.polling,
    )
    keeper.start()
    try:
        yield keeper
    finally:
        keeper.stop()


@contextlib.contextmanager
def prometheus_endpoint(
    port: int | None, address: str | None
) -> Iterator[metrics_prometheus.PrometheusMetrics | None]:
    """The Prometheus metrics of `--metrics-port` (or OUTBOX_NOTIFY_METRICS_PORT), served at
    /metrics and /healthz while the block runs; None when neither asks for them."""
    port = conf.metrics_port() if port is None else port
    if port is None:
        yield None
        return
    exporter = metrics_prometheus.PrometheusMetrics()
    endpoint = metrics_prometheus.serve(exporter, address or conf.metrics_address(), port)
    try:
        yield exporter
    finally:
        endpoint.close()


def check_reachable(relay: Relay) -> None:
    """Connect to PostgreSQL and the broker once; raise with a clear message if either fails."""
    try:
        relay.ensure_connected()
    except DatabaseUnavailable as exc:
        relay.disconnect()
        raise OutboxNotifyError(f"PostgreSQL cannot be reached: {_one_line(exc)}") from exc
    try:
        relay.publisher.check()
    except BrokerUnavailable as exc:
        relay.disconnect()
        raise OutboxNotifyError(f"the broker cannot be reached: {_one_line(exc)}") from exc


def _one_line(exc: Exception) -> str:
    # libpq's messages span lines ("Is the server running on that host...?"); a start-up
    # failure should read as one line in a terminal or a log collector.
    return " ".join(str(exc).split())


@contextlib.contextmanager
def stop_signals(relay_holder: list[Relay]) -> Iterator[int]:
    """Route SIGTERM/SIGINT to Relay.request_stop and wake a blocked relay through a pipe."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def handler(signum: int, frame: Any) -> None:
        for relay in relay_holder:
            relay.request_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield read_fd
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(previous_fd)
        os.close(read_fd)
        os.close(write_fd)
