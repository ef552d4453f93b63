"""OUTBOX_NOTIFY_EXCLUDE_TASKS end to end: straight to a real broker, run by a real worker.

The sending app is an OutboxCelery of the test's own on the broker under test (Redis or
RabbitMQ), routing to this test's queue; the worker is `celery worker` on the same broker.
No relay runs unless the test starts one, so an execution of an excluded task proves it went
straight to the broker.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
import structlog
from celery import group
from celery.beat import ScheduleEntry, Scheduler
from django.db import transaction
from django.test import override_settings

from outbox_notify import OutboxCelery
from outbox_notify.models import OutboxMessage
from tests.relay_support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]
# transaction=True: the relay (when there is one) is another process; only commits reach it.

EXCLUDED = "tests.record_direct"
THROUGH_OUTBOX = "tests.record"


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The URL of the broker under test."""
    fixture = "redis_url" if request.param == "redis" else "amqp_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def sender(broker_url: str, queue_name: str) -> Iterator[OutboxCelery]:
    """An OutboxCelery on the broker under test (Celery gives it the suite's shared tasks)."""
    app = OutboxCelery("excluded-sender", broker=broker_url, fixups=[], set_as_current=False)
    app.conf.update(task_default_queue=queue_name, task_ignore_result=True, enable_utc=True)
    assert {EXCLUDED, THROUGH_OUTBOX} <= set(app.tasks)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def env(relay_env: dict[str, Any], broker_url: str) -> dict[str, Any]:
    """Worker and relay environment on the broker under test."""
    return dict(relay_env, OUTBOX_TEST_BROKER_URL=broker_url)


def waiting_in_broker(app: OutboxCelery, queue: str) -> int:
    """How many messages wait in `queue` on the app's broker (none consumed)."""
    with app.connection_for_write() as connection:
        queue_object = kombu.Queue(queue, channel=connection.channel())
        try:
            _, count, _ = queue_object.queue_declare(passive=True)
        except connection.channel_errors:
            return 0
        return int(count)


def executed(path: Path) -> dict[str, dict[str, Any]]:
    """What the worker ran, by task id."""
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {entry["id"]: entry for entry in lines}


@override_settings(OUTBOX_NOTIFY_EXCLUDE_TASKS=[EXCLUDED])
def test_an_excluded_task_is_published_at_once_and_a_worker_runs_it(
    sender: OutboxCelery, queue_name: str, env: dict[str, Any], start_worker: Any
) -> None:
    """delay(), send_task() and a group of an excluded task reach the broker inside the
    transaction, write no outbox row, and a worker runs them with no relay running."""
    task = sender.tasks[EXCLUDED]
    with transaction.atomic():
        sent = [
            task.delay("delay"),
            sender.send_task(EXCLUDED, ("send_task",)),
            task.apply_async(("countdown",), countdown=1),
        ]
        grouped = group(task.si("group-a"), task.si("group-b")).apply_async()
        sent += list(grouped.results)
        # Still inside the transaction. (A publish without confirms reaches the queue a moment
        # after it returns, hence the wait.)
        wait_for(
            lambda: waiting_in_broker(sender, queue_name) == len(sent),
            what="every excluded task in the broker's queue",
        )
    assert OutboxMessage.objects.count() == 0
    records = start_worker(queue_name, env=env)
    ran = wait_for(
        lambda: (found := executed(records)) and len(found) >= len(sent) and found,
        what="the worker to run every excluded task",
    )
    assert {result.id for result in sent} == set(ran)
    assert sorted(entry["args"][0] for entry in ran.values()) == [
        "countdown",
        "delay",
        "group-a",
        "group-b",
        "send_task",
    ]


@override_settings(OUTBOX_NOTIFY_EXCLUDE_TASKS=[EXCLUDED])
def test_beat_sends_an_excluded_task_to_the_broker_and_another_to_the_outbox(
    sender: OutboxCelery,
    queue_name: str,
    env: dict[str, Any],
    start_worker: Any,
    start_relay: Any,
) -> None:
    """Celery beat's send (a pooled producer passed in): the excluded task goes straight to the
    broker; the other is an outbox row written in autocommit with its warning, then relayed."""
    scheduler = Scheduler(app=sender, schedule={}, lazy=True)
    every = dt.timedelta(hours=1)
    entries = [
        ScheduleEntry(name=name, task=name, args=(name,), schedule=every, app=sender)
        for name in (EXCLUDED, THROUGH_OUTBOX)
    ]
    try:
        with structlog.testing.capture_logs() as logs:
            for entry in entries:
                # Beat's own call for a due entry; it logs and swallows what the send raises.
                scheduler.apply_entry(entry, producer=scheduler.producer)
    finally:
        scheduler.producer.connection.close()
    wait_for(
        lambda: waiting_in_broker(sender, queue_name) == 1, what="the excluded task in the queue"
    )
    row = OutboxMessage.objects.get()
    assert row.task_name == THROUGH_OUTBOX
    warned = [e for e in logs if e["event"] == "outbox.enqueue_outside_transaction"]
    assert [e["task_name"] for e in warned] == [THROUGH_OUTBOX]
    records = start_worker(queue_name, env=env)
    wait_for(lambda: EXCLUDED in _markers(records), what="the excluded task's execution")
    start_relay("--sweep-interval", "1", env=env)
    wait_for(lambda: THROUGH_OUTBOX in _markers(records), what="the relayed task's execution")
    assert executed(records)[row.task_id]["args"] == [THROUGH_OUTBOX]


def _markers(path: Path) -> list[str]:
    return [entry["args"][0] for entry in executed(path).values()]
