"""A real `outbox_listen --metrics-port` scraped over HTTP; `outbox_stats --format prometheus`."""

from __future__ import annotations

import io
import re
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from outbox_notify.metrics_prometheus import PREFIX, STATS_GAUGES
from outbox_notify.models import DeadLetter
from tests.integration.test_relay import FAST, enqueue
from tests.integration.test_relay_faults import terminate
from tests.relay_support import RedisQueue, wait_for
from tests.unit.test_metrics_prometheus import get, samples

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay is another process and sees only committed rows.

HELD = 3600  # seconds of countdown: far enough ahead for the row to be held in the outbox


def port_of(relay: Any) -> int:
    """The port the relay's metrics endpoint got (it was started with --metrics-port 0)."""
    found = wait_for(
        lambda: re.search(r"outbox\.metrics_serving.*?port\W+(\d+)", relay.output()),
        what="outbox.metrics_serving",
        context=relay.output,
    )
    return int(found.group(1))


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = get(base + "/metrics")
    assert status == 200
    return samples(body)


def allow_connections(allowed: bool) -> None:
    """Let (or stop) new sessions reach the test database; sessions already open stay.

    Run from the server's `postgres` database: a session cannot refuse its own database.
    """
    params = {**connection.get_connection_params(), "dbname": "postgres", "autocommit": True}
    for django_only in ("cursor_factory", "context", "server_side_binding", "pool"):
        params.pop(django_only, None)
    name = connection.settings_dict["NAME"]
    with psycopg.connect(**params) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.SQL("true" if allowed else "false")
            )
        )


def test_a_scrape_shows_what_the_relay_did(start_relay: Any, redis_queue: RedisQueue) -> None:
    """Counters, histograms and gauges move at /metrics as a real relay publishes; /healthz
    is 200 while it listens."""
    enqueue(redis_queue.name, count=2, countdown=HELD)
    ids = enqueue(redis_queue.name, count=5)
    relay = start_relay("--metrics-port", "0", *FAST)
    base = f"http://127.0.0.1:{port_of(relay)}"
    wait_for(lambda: set(ids) <= set(redis_queue.task_ids()), what="the publishes")
    task = (("task_name", "tests.add"),)
    got = wait_for(
        lambda: (s := scrape(base)).get((PREFIX + "published_total", task), 0) >= 5 and s,
        what="published_total to count the publishes",
    )
    assert got[(PREFIX + "batch_duration_seconds_count", ())] >= 1
    assert got[(PREFIX + "batch_size_rows_sum", ())] >= 5
    assert got[(PREFIX + "lag_seconds_count", ())] >= 1
    assert got[(PREFIX + "relay_connected", ())] == 1
    assert got[(PREFIX + "relay_listening", ())] == 1
    # The two held rows are still in the outbox: the depth gauge counts them.
    wait_for(
        lambda: scrape(base).get((PREFIX + "queue_depth_rows", ())) == 2,
        what="the depth gauge to count the held rows",
    )
    assert get(base + "/healthz") == (200, "listening\n")


RETRYING = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
    " schema_version, retries, last_error, retry_after)"
    " VALUES (%s, 'tests.add', '[]', '{}', '{}', 1, 2, 'boom', now() + interval '1 hour')"
)


def test_the_relay_serves_the_backlog_gauges_outbox_stats_writes(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """Due, held, retrying, dead letters and relays listening at the relay's /metrics, under
    outbox_stats's names, counted from the real tables."""
    enqueue(redis_queue.name, count=2, countdown=HELD)
    with connection.cursor() as cursor:
        for task_id in ("retrying-1", "retrying-2", "retrying-3"):
            cursor.execute(RETRYING, [task_id])
    DeadLetter.objects.create(
        task_id="dead-1", task_name="tests.add", args=[], kwargs={}, options={}, failure_reason="x"
    )
    ids = enqueue(redis_queue.name, count=4)
    relay = start_relay("--metrics-port", "0", *FAST)
    base = f"http://127.0.0.1:{port_of(relay)}"
    wait_for(lambda: set(ids) <= set(redis_queue.task_ids()), what="the publishes")
    gauges = ("queue_depth_rows", "queue_due_rows", "queue_held_rows", "queue_retrying_rows")
    gauges += ("dead_letters_rows", "relays_listening")
    # The gauges are read after a drain: wait for a read that saw the four published.
    got = wait_for(
        lambda: (s := scrape(base)).get((PREFIX + "queue_depth_rows", ())) == 5 and s,
        what="the depth gauge to count the held and retrying rows",
        context=relay.output,
    )
    assert {name: got.get((PREFIX + name, ())) for name in gauges} == {
        "queue_depth_rows": 5,
        "queue_due_rows": 0,
        "queue_held_rows": 2,
        "queue_retrying_rows": 3,
        "dead_letters_rows": 1,
        "relays_listening": 1,
    }


def test_healthz_is_503_while_postgresql_cannot_be_reached(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """With its connections cut and new ones refused, the relay's /healthz answers 503;
    it is 200 again once the relay reconnects."""
    relay = start_relay("--metrics-port", "0", "--poll-only", *FAST)
    base = f"http://127.0.0.1:{port_of(relay)}"
    wait_for(lambda: get(base + "/healthz") == (200, "polling\n"), what="healthz 200")
    connection.ensure_connection()  # terminate() runs on it once new sessions are refused
    allow_connections(False)
    try:
        terminate("outbox_notify.claim")
        wait_for(
            lambda: get(base + "/healthz")[0] == 503,
            what="healthz 503 while disconnected",
            context=relay.output,
        )
        assert scrape(base)[(PREFIX + "relay_connected", ())] == 0
    finally:
        allow_connections(True)
    wait_for(
        lambda: get(base + "/healthz") == (200, "polling\n"),
        what="healthz 200 after the reconnect",
        context=relay.output,
    )


def test_outbox_stats_writes_the_gauges_in_prometheus_format(redis_queue: RedisQueue) -> None:
    """`outbox_stats --format prometheus`: every gauge, from the real table's figures."""
    enqueue(redis_queue.name, count=2, countdown=HELD)
    enqueue(redis_queue.name, count=3)
    out = io.StringIO()
    call_command("outbox_stats", "--format", "prometheus", stdout=out)
    families = {f.name: f for f in text_string_to_metric_families(out.getvalue())}
    assert set(families) == {PREFIX + name for name in STATS_GAUGES}
    value = {name: f.samples[0].value for name, f in families.items()}
    assert value[PREFIX + "queue_depth_rows"] == 5
    assert value[PREFIX + "queue_held_rows"] == 2
    assert value[PREFIX + "queue_due_rows"] == 3
    assert value[PREFIX + "dead_letters_rows"] == 0
