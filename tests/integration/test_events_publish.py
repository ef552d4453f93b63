"""Domain events through a real relay into real RabbitMQ and Redis: CloudEvents, once, never rolled back."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import amqp
import pytest
import redis
from django.db import transaction
from kombu import Connection, Exchange, Queue

from outbox_notify import events
from outbox_notify.events import envelope as wire
from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add
from tests.integration.test_relay import FAST, ready
from tests.relay_support import RedisQueue, decode_envelope, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay is another process and sees only committed rows.

SOURCE = "/tests/outbox-notify"  # tests/settings.py OUTBOX_NOTIFY_EVENT_SOURCE


@dataclasses.dataclass(frozen=True)
class OrderPlaced:
    """A domain event whose type is its qualified class name."""

    order_id: int
    total: decimal.Decimal
    placed_at: dt.datetime
    lines: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class CardCreated:
    """A domain event that names its own type."""

    event_type: ClassVar[str] = "library.card.created"
    card: str


PLACED_AT = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def _order(order_id: int = 7) -> OrderPlaced:
    return OrderPlaced(
        order_id=order_id,
        total=decimal.Decimal("12.50"),
        placed_at=PLACED_AT,
        lines=[{"sku": "A-1", "qty": 2}],
    )


@pytest.fixture
def rabbit(amqp_url: str, queue_name: str) -> Iterator[tuple[amqp.Channel, str]]:
    """A queue bound to a durable topic exchange (as publish declares it) on the shared RabbitMQ."""
    host = amqp_url.split("@", 1)[1].rstrip("/")
    conn = amqp.Connection(host, userid="guest", password="guest")
    conn.connect()
    channel = conn.channel()
    exchange = f"{queue_name}-events"
    channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
    channel.queue_declare(queue_name, durable=True, auto_delete=False)
    channel.queue_bind(queue_name, exchange, "#")
    channel.queue_declare(f"{queue_name}-tasks", durable=True, auto_delete=False)  # as Celery does
    try:
        yield channel, exchange
    finally:
        cleanup = conn.channel()
        cleanup.queue_delete(queue_name)
        cleanup.queue_delete(f"{queue_name}-tasks")
        for name in (exchange, f"{exchange}-nobody", f"{exchange}-missing"):
            cleanup.exchange_delete(name)
        conn.close()


@pytest.fixture
def amqp_relay(start_relay: Any, relay_env: dict[str, Any], amqp_url: str) -> Any:
    """A relay publishing to the shared RabbitMQ."""
    relay = start_relay(
        *FAST, "--max-retries", "1", env=dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)
    )
    ready(relay)
    return relay


def _take(channel: amqp.Channel, queue: str) -> amqp.Message | None:
    return channel.basic_get(queue, no_ack=True)


def _check_cloudevent(
    body: bytes | str, properties: dict[str, Any], sent: wire.Envelope, extra: dict[str, Any]
) -> None:
    """Every attribute in the body and every binding header, as the envelope module encodes them."""
    # py-amqp hands the body over decoded with its content_encoding.
    body = body.encode("utf-8") if isinstance(body, str) else body
    assert body == wire.encode(sent)
    attributes = json.loads(body)
    assert attributes["specversion"] == "1.0"
    assert attributes["id"] == sent.id
    assert attributes["source"] == SOURCE
    assert attributes["type"] == sent.type
    assert attributes["time"] == sent.time.isoformat().replace("+00:00", "Z")
    assert attributes["datacontenttype"] == "application/json"
    assert wire.decode(body) == sent
    assert properties["content_type"] == "application/cloudevents+json"
    assert properties["content_encoding"] == "utf-8"
    assert properties["delivery_mode"] == 2
    assert properties["application_headers"] == {**wire.binding_headers(sent), **extra}


@pytest.mark.rabbitmq
def test_committed_event_arrives_once_on_rabbitmq_and_a_rolled_back_one_never(
    rabbit: tuple[amqp.Channel, str], amqp_relay: Any, queue_name: str
) -> None:
    """A committed dataclass event arrives once as a valid CloudEvent; a rolled-back one never."""
    channel, exchange = rabbit

    class Rollback(Exception):
        """Ends the transaction that publishes the event nobody may see."""

    with pytest.raises(Rollback), transaction.atomic():
        events.publish(_order(1), exchange=exchange)
        raise Rollback
    with transaction.atomic():
        sent = events.publish(_order(2), exchange=exchange, headers={"x-tenant": "acme"})
    message = wait_for(
        lambda: _take(channel, queue_name), what="the event", context=amqp_relay.output
    )
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted after publish")
    assert _take(channel, queue_name) is None, "one event was committed, one arrives"
    _check_cloudevent(message.body, message.properties, sent, {"x-tenant": "acme"})
    assert message.delivery_info["exchange"] == exchange
    assert message.delivery_info["routing_key"] == f"{__name__}.OrderPlaced"
    data = wire.decode(message.body).data
    assert data["order_id"] == 2
    assert data["total"] == decimal.Decimal("12.50")
    assert data["placed_at"] == PLACED_AT


@pytest.mark.rabbitmq
def test_unroutable_and_missing_exchange_events_are_dead_lettered_beside_working_tasks(
    rabbit: tuple[amqp.Channel, str], amqp_relay: Any, queue_name: str
) -> None:
    """An event nobody is bound for, and one whose passive exchange does not exist, are retried
    then dead-lettered with their reasons; tasks and a good event still go through the relay."""
    channel, exchange = rabbit
    with transaction.atomic():
        nobody = events.publish(CardCreated(card="c-1"), exchange=f"{exchange}-nobody")
        missing = events.publish(
            {"type": "library.card.lost", "data": None},
            exchange=Exchange(f"{exchange}-missing", type="topic", passive=True),
        )
        good = events.publish(CardCreated(card="c-2"), exchange=exchange, routing_key="cards.new")
        task_id = add.apply_async((2, 3), queue=f"{queue_name}-tasks").id
    wait_for(
        lambda: DeadLetter.objects.count() == 2,
        what="both bad events dead-lettered",
        context=amqp_relay.output,
    )
    reasons = dict(DeadLetter.objects.values_list("task_id", "failure_reason"))
    assert "unroutable" in reasons[nobody.id], reasons
    assert "NOT_FOUND" in reasons[missing.id] or "404" in reasons[missing.id], reasons
    assert set(DeadLetter.objects.values_list("task_name", flat=True)) == {
        "library.card.created",
        "library.card.lost",
    }
    message = wait_for(lambda: _take(channel, queue_name), what="the good event")
    _check_cloudevent(message.body, message.properties, good, {})
    assert message.delivery_info["routing_key"] == "cards.new"
    task = wait_for(lambda: _take(channel, f"{queue_name}-tasks"), what="the task")
    assert task.properties["application_headers"]["id"] == task_id
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the outbox drained")


@pytest.fixture
def redis_exchange(redis_url: str, queue_name: str) -> Iterator[str]:
    """A topic exchange on Redis with this test's queue bound to every key ("#")."""
    exchange = Exchange(f"{queue_name}-events", type="topic", durable=True)
    with Connection(redis_url) as conn:
        Queue(queue_name, exchange, routing_key="#")(conn.default_channel).declare()
    client = redis.Redis.from_url(redis_url)
    try:
        yield exchange.name
    finally:
        for key in client.keys(f"*{queue_name}*"):
            client.delete(key)
        client.close()


def test_committed_event_arrives_once_on_redis_with_tasks_in_the_same_relay(
    redis_exchange: str, start_relay: Any, redis_queue: RedisQueue
) -> None:
    """On Redis an event and a task of one transaction both arrive, the event as a CloudEvent;
    a rolled-back event never does."""
    relay = start_relay(*FAST)
    ready(relay)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        events.publish(CardCreated(card="never"), exchange=redis_exchange)
        _ = 1 / 0
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    event_id = str(uuid.uuid4())
    with transaction.atomic():
        sent = events.publish(
            {
                "type": "shop.order.shipped",
                "data": {"n": 1},
                "id": event_id,
                "subject": "o-9",
                "time": when,
            },
            exchange=redis_exchange,
            headers={"x-priority-lane": "b"},
        )
        task_id = add.apply_async((1, 1), queue=redis_queue.name).id
    wait_for(lambda: len(redis_queue.messages()) == 2, what="event and task", context=relay.output)
    wait_for(lambda: not OutboxMessage.objects.exists(), what="both rows deleted")
    raw = [
        decode_envelope(item)
        for item in reversed(redis_queue.client.lrange(redis_queue.name, 0, -1))
    ]
    kinds = {m["properties"]["delivery_info"]["routing_key"]: m for m in raw}
    event = kinds["shop.order.shipped"]
    assert sent.id == event_id
    assert sent.time == when.astimezone(dt.UTC)
    assert event["body"] == json.loads(wire.encode(sent))
    assert event["content-type"] == "application/cloudevents+json"
    assert event["content-encoding"] == "utf-8"
    assert event["properties"]["delivery_mode"] == 2
    assert event["properties"]["delivery_info"]["exchange"] == redis_exchange
    assert event["headers"] == {**wire.binding_headers(sent), "x-priority-lane": "b"}
    assert event["headers"]["cloudEvents_subject"] == "o-9"
    assert [m["headers"].get("id") for m in raw if "id" in m["headers"]] == [task_id]


def test_unroutable_event_on_redis_is_dead_lettered_not_dropped(
    redis_exchange: str, start_relay: Any, redis_queue: RedisQueue
) -> None:
    """kombu would drop an event no Redis queue is bound for; the relay dead-letters it instead."""
    relay = start_relay(*FAST, "--max-retries", "1")
    ready(relay)
    with transaction.atomic():
        routed = events.publish(CardCreated(card="c"), exchange=redis_exchange, routing_key="x")
    # The queue is bound with "#": route around it with an exchange nobody is bound to.
    with transaction.atomic():
        nobody = events.publish(CardCreated(card="d"), exchange=f"{redis_exchange}-nobody")
    wait_for(DeadLetter.objects.exists, what="a dead letter", context=relay.output)
    dead = DeadLetter.objects.get()
    assert dead.task_id == nobody.id
    assert "unroutable" in dead.failure_reason
    assert [m["body"]["id"] for m in redis_queue.messages()] == [routed.id]
