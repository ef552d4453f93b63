"""A real, unmodified Celery worker executes what the relay publishes, options and all."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import chain, chord, group
from django.db import transaction
from django.test import override_settings
from kombu import Exchange

from outbox_notify import OutboxCelery
from outbox_notify.models import OutboxMessage
from tests.celery_app import fail, record
from tests.relay_support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]
# transaction=True: the relay and the worker are other processes; only commits reach them.

FAST = ["--sweep-interval", "1"]


def executions(path: Path) -> list[dict[str, Any]]:
    """What the worker recorded, one dict per execution."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_marker(path: Path) -> dict[str, dict[str, Any]]:
    """Executions keyed by their first string argument (each test call passes a marker)."""
    return {next((a for a in e["args"] if isinstance(a, str)), ""): e for e in executions(path)}


def test_worker_runs_every_contract_option(
    start_relay: Any, start_worker: Any, queue_name: str
) -> None:
    """countdown, expires (timedelta), priority, headers, limits, shadow, ignore_result, link,
    link_error, chain, group, chord and exchange/routing_key all reach the worker intact."""
    q = queue_name
    relay = start_relay(*FAST)
    record_file = start_worker(q)
    enqueued_at = dt.datetime.now(dt.UTC)
    with transaction.atomic():
        plain = record.apply_async(
            ("options",),
            {"k": "v"},
            queue=q,
            countdown=1,
            expires=dt.timedelta(minutes=5),
            priority=5,
            headers={"x-tenant": "acme"},
            time_limit=30,
            soft_time_limit=20,
            shadow="record-shadowed",
            ignore_result=True,
            link=record.si("linked").set(queue=q),
        )
        fail.apply_async(("boom",), queue=q, link_error=record.si("errback").set(queue=q))
        chained = chain(
            record.si("chain-1").set(queue=q), record.si("chain-2").set(queue=q)
        ).apply_async()
        group(record.si("group-a").set(queue=q), record.si("group-b").set(queue=q)).apply_async()
        chord([record.si("header-1").set(queue=q), record.si("header-2").set(queue=q)])(
            record.s("body").set(queue=q)
        )
        routed = record.apply_async(("routed",), exchange=Exchange(q), routing_key=q)
    wanted = {
        "options",
        "linked",
        "errback",
        "chain-1",
        "chain-2",
        "group-a",
        "group-b",
        "header-1",
        "header-2",
        "body",
        "routed",
    }
    seen = wait_for(
        lambda: (found := by_marker(record_file)) and wanted <= found.keys() and found,
        timeout=60,
        what="every execution",
        context=lambda: f"seen {sorted(by_marker(record_file))}\n{relay.output()[-3000:]}",
    )
    options = seen["options"]
    assert options["id"] == plain.id
    assert options["kwargs"] == {"k": "v"}
    eta = dt.datetime.fromisoformat(options["eta"])
    assert eta >= enqueued_at + dt.timedelta(seconds=0.9)
    expires = dt.datetime.fromisoformat(options["expires"])
    assert dt.timedelta(minutes=4) < expires - enqueued_at <= dt.timedelta(minutes=5, seconds=5)
    assert options["delivery_info"]["priority"] == 5
    assert options["headers"].get("x-tenant") == "acme" or options.get("x-tenant") == "acme"
    assert options["timelimit"] == [30, 20]
    assert options["ignore_result"] is True
    assert seen["chain-2"]["parent_id"] == chained.parent.id
    assert seen["chain-2"]["root_id"] == chained.parent.id
    assert seen["group-a"]["group"] == seen["group-b"]["group"] is not None
    assert seen["body"]["args"][0] == ["recorded", "recorded"]
    assert seen["routed"]["id"] == routed.id
    assert seen["routed"]["delivery_info"]["routing_key"] == q


@pytest.fixture
def new_york_senders(relay_env: dict[str, Any]) -> Iterator[tuple[OutboxCelery, celery.Celery]]:
    """An OutboxCelery and a plain Celery app on the test's Redis, timezone America/New_York."""
    broker = relay_env["OUTBOX_TEST_BROKER_URL"]
    apps = (
        OutboxCelery("worker-new-york", broker=broker, fixups=[], set_as_current=False),
        celery.Celery("plain-new-york", broker=broker, fixups=[], set_as_current=False),
    )
    for each in apps:
        each.conf.update(timezone="America/New_York", enable_utc=True, task_ignore_result=True)
    yield apps
    for each in apps:
        each.close()


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=1)
def test_a_naive_eta_held_in_the_outbox_runs_when_the_worker_reads_it_due(
    new_york_senders: tuple[OutboxCelery, celery.Celery],
    start_relay: Any,
    start_worker: Any,
    relay_env: dict[str, Any],
    queue_name: str,
) -> None:
    """In an app on New York time, a naive eta a few seconds ahead (UTC, as Celery's worker
    reads it) is held that long, not 5 hours more, and reaches the worker as plain Celery's."""
    outbox_app, plain_app = new_york_senders
    naive = dt.datetime.now(dt.UTC).replace(tzinfo=None) + dt.timedelta(seconds=5)
    options = {"eta": naive, "expires": naive + dt.timedelta(hours=1), "queue": queue_name}
    with transaction.atomic():
        through_outbox = outbox_app.send_task("tests.record", ("outbox",), **options)
    assert OutboxMessage.objects.get().retry_after == naive.replace(tzinfo=dt.UTC)
    direct = plain_app.send_task("tests.record", ("plain",), **options)
    env = dict(relay_env, OUTBOX_TEST_TIMEZONE="America/New_York")
    start_relay(*FAST, env=env)
    record_file = start_worker(queue_name, env=env)
    seen = wait_for(
        lambda: (found := by_marker(record_file)) and {"outbox", "plain"} <= found.keys() and found,
        what="both executions",
    )
    assert seen["outbox"]["id"] == through_outbox.id
    assert seen["plain"]["id"] == direct.id
    for key in ("eta", "expires"):
        assert seen["outbox"][key] == seen["plain"][key]
