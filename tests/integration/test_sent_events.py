"""task_send_sent_event: the relay publishes Celery's `task-sent` event when it sends the task."""

from __future__ import annotations

import datetime as dt
import socket
import uuid
from typing import Any

import pytest
import structlog
from django.db import transaction
from kombu import Connection, Exchange, Queue

from outbox_notify import OutboxCelery, conf
from outbox_notify.models import OutboxMessage
from outbox_notify.relay import messages
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.publisher import Result
from outbox_notify.relay.sent_events import SentEventPublisher
from outbox_notify.testing import RecordingPublisher, SavepointStore
from tests.celery_app import add

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay store claims committed rows, as a real relay would.


def _events_app(broker_url: str, exchange: str) -> Any:
    events_app = OutboxCelery(f"events-{exchange}", set_as_current=False)
    events_app.conf.update(
        broker_url=broker_url,
        task_send_sent_event=True,
        event_exchange=exchange,
        task_default_queue="outbox-events-tests",
    )
    return events_app


def _echo(x: int) -> int:
    """The task the event tests enqueue."""
    return x


def test_the_write_side_stores_the_sent_event_fields() -> None:
    """With task_send_sent_event the row carries the event's fields; without it, nothing."""
    events_app = _events_app("redis://127.0.0.1:1/0", "unused")
    task = events_app.task(name="tests.evented")(_echo)
    with transaction.atomic():
        sent = task.delay(5)
        plain = add.delay(1, 1)
    rows = {row.task_id: row.options for row in OutboxMessage.objects.all()}
    event = rows[sent.id]["sent_event"]
    assert (event["uuid"], event["name"], event["args"]) == (sent.id, "tests.evented", "(5,)")
    assert event["queue"] == "outbox-events-tests"
    assert "sent_event" not in rows[plain.id]


def test_the_relay_publishes_task_sent_through_the_apps_event_exchange(amqp_url: str) -> None:
    """After the task is published, a task-sent event arrives on the configured exchange."""
    exchange = f"outbox-events-{uuid.uuid4().hex[:8]}"
    events_app = _events_app(amqp_url, exchange)
    task = events_app.task(name="tests.evented")(_echo)
    watch = Queue(
        f"{exchange}-watch",
        Exchange(exchange, type="topic"),
        routing_key="task.#",
        auto_delete=True,
    )
    with Connection(amqp_url) as conn:
        watch(conn.default_channel).declare()
        with transaction.atomic():
            sent = task.delay(5)
        publisher = SentEventPublisher(RecordingPublisher(), events_app)
        relay = Relay(
            RelayConfig(),
            store=SavepointStore(conf.database_alias()),
            listener=None,
            publisher=publisher,
        )
        relay.drain()
        publisher.close()
        message = conn.SimpleQueue(watch).get(timeout=10)
        event = message.payload
        message.ack()
    assert event["type"] == "task-sent"
    assert (event["uuid"], event["name"], event["queue"]) == (
        sent.id,
        "tests.evented",
        "outbox-events-tests",
    )
    assert event["hostname"]
    assert event["timestamp"]
    assert OutboxMessage.objects.count() == 0


def _prepared(task: Any, *values: int) -> list[Any]:
    """The relay's messages for the rows of `task.delay(value)` for each value (committed,
    then claimed)."""
    with transaction.atomic():
        for value in values:
            task.delay(value)
    store = SavepointStore(conf.database_alias())
    with store.claim(10) as claim:
        rows = list(claim.rows)
    now = dt.datetime.now(dt.UTC)
    return [messages.prepare(row, now) for row in rows]


def test_events_with_no_time_left_in_the_claim_are_dropped_not_sent(amqp_url: str) -> None:
    """Events go out inside the batch's claim: when no broker step fits before its deadline,
    they are logged and dropped, and the task's own outcome is unchanged."""
    exchange = f"outbox-events-{uuid.uuid4().hex[:8]}"
    events_app = _events_app(amqp_url, exchange)
    task = events_app.task(name="tests.evented")(_echo)
    watch = Queue(
        f"{exchange}-watch",
        Exchange(exchange, type="topic"),
        routing_key="task.#",
        auto_delete=True,
    )
    with Connection(amqp_url) as conn:
        watch(conn.default_channel).declare()
        publisher = SentEventPublisher(RecordingPublisher(), events_app, send_timeout=1.0)
        with structlog.testing.capture_logs() as logs:
            attempts = publisher.publish(_prepared(task, 5), lambda: True)  # too late already
        publisher.close()
        assert [a.result for a in attempts] == [Result.PUBLISHED]
        assert conn.SimpleQueue(watch).qsize() == 0
    [failed] = [e for e in logs if e["event"] == "outbox.sent_event_failed"]
    assert failed["count"] == 1


def test_an_events_broker_that_never_answers_costs_the_claim_one_send_timeout() -> None:
    """A broker that accepts the connection and says nothing: the events connection gives up
    after --send-timeout, once for the batch (Celery's dispatcher buffered each event and
    tried to connect again for the next, a connect timeout each, inside the claim)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        events_app = _events_app(f"amqp://guest:guest@127.0.0.1:{port}//", "unused")
        task = events_app.task(name="tests.evented")(_echo)
        publisher = SentEventPublisher(RecordingPublisher(), events_app, send_timeout=0.5)
        with structlog.testing.capture_logs() as logs:
            attempts = publisher.publish(_prepared(task, 6, 7, 8), lambda: False)
        publisher.close()
    assert [a.result for a in attempts] == [Result.PUBLISHED] * 3
    assert [e["count"] for e in logs if e["event"] == "outbox.sent_event_failed"] == [3]
