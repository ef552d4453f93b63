"""An event row leaves each relay path as exactly what kombu's Producer.publish sends for it.

The reference publish is the one the events design names: body `encode(envelope)`, content
type `application/cloudevents+json`, UTF-8, the binding headers plus the caller's, persistent,
to the exchange (declared as configured) with the routing key. The relay's paths (kombu's
general path, the RabbitMQ pipelined publisher, the Redis pipeline, which looks bindings up
once per exchange and routing key in a batch) must deliver the same bytes and properties, and
on Redis fill the same lists as kombu's exchange emulation.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import celery
import pytest
import redis
import structlog
from kombu import Connection, Exchange, Producer, Queue

from outbox_notify.events import envelope as wire
from outbox_notify.events.publishing import event_row
from outbox_notify.relay import messages
from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.publisher import KombuPublisher, Result
from outbox_notify.relay.redis_publisher import RedisPipelinePublisher
from outbox_notify.relay.store import ClaimedRow
from tests.integration.test_fast_path import claimed, normalised

WHEN = dt.datetime(2026, 11, 26, 9, 30, 15, 123456, tzinfo=dt.UTC)
HEADERS = {"x-tenant": "acme", "x-attempt": 3}


def _envelope(**changes: Any) -> wire.Envelope:
    base = wire.Envelope(
        id=str(uuid.uuid4()),
        source="/tests/equivalence",
        type="shop.order.placed",
        time=WHEN,
        data={"order": 7, "when": WHEN, "key": uuid.UUID(int=5), "name": "caf\u00e9"},
        subject="order-7",
    )
    return dataclasses.replace(base, **changes)


def _claimed(envelope: wire.Envelope, exchange: str | Exchange, routing_key: str) -> ClaimedRow:
    row = event_row(envelope, exchange=exchange, routing_key=routing_key, headers=HEADERS)
    return ClaimedRow(
        1, row.task_id, row.task_name, row.args, row.kwargs, row.options, row.context, 0,
        row.schema_version, dt.datetime.now(dt.UTC),
    )  # fmt: skip


def _reference(conn: Connection, envelope: wire.Envelope, exchange: Exchange, key: str) -> None:
    """What the events design says the relay sends, through kombu's own Producer.publish."""
    producer = Producer(conn.default_channel)
    producer.publish(
        wire.encode(envelope),
        exchange=exchange,
        routing_key=key,
        content_type=wire.CONTENT_TYPE,
        content_encoding="utf-8",
        headers={**wire.binding_headers(envelope), **HEADERS},
        delivery_mode=2,
        declare=[exchange],
    )


@pytest.fixture
def broker(amqp_url: str) -> Iterator[amqp.Channel]:
    """A raw py-amqp channel on the shared RabbitMQ, to set up and read queues."""
    host = amqp_url.split("@", 1)[1].rstrip("/")
    conn = amqp.Connection(host, userid="guest", password="guest")
    conn.connect()
    try:
        yield conn.channel()
    finally:
        conn.close()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("declared", ["name", "exchange-object"])
def test_event_on_rabbitmq_equals_kombus_publish_on_every_path(
    declared: str, broker: amqp.Channel, amqp_url: str, queue_name: str
) -> None:
    """Reference publish, the general path and the pipelined path deliver identical messages."""
    name = f"{queue_name}-events"
    exchange = Exchange(name, type="topic", durable=True)
    configured: str | Exchange = name if declared == "name" else exchange
    envelope = _envelope()
    message = messages.prepare(
        _claimed(envelope, configured, "orders.eu.placed"), dt.datetime.now(dt.UTC)
    )
    app = celery.Celery("event-equivalence", broker=amqp_url, set_as_current=False)
    general = KombuPublisher(app, send_timeout=5)
    fast = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=5))
    try:
        broker.exchange_declare(name, "topic", durable=True, auto_delete=False)
        broker.queue_declare(queue_name, durable=True, auto_delete=False)
        broker.queue_bind(queue_name, name, "orders.#")
        with Connection(amqp_url) as conn:
            _reference(conn, envelope, exchange, "orders.eu.placed")
        assert general.publish([message], lambda: False)[0].result is Result.PUBLISHED
        fast.check()
        assert fast.session is not None, "the fast path was not used"
        assert fast.publish([message], lambda: False)[0].result is Result.PUBLISHED
        got = [broker.basic_get(queue_name, no_ack=True) for _ in range(3)]
    finally:
        general.close()
        fast.close()
        broker.queue_delete(queue_name)
        broker.exchange_delete(name)
    assert None not in got, "each publish delivered one message"
    reference, via_kombu, via_fast_path = got
    for other in (via_kombu, via_fast_path):
        assert other.body == reference.body
        assert other.properties == reference.properties
        for key in ("exchange", "routing_key"):
            assert other.delivery_info[key] == reference.delivery_info[key]
    assert reference.body.encode() == wire.encode(envelope)
    assert reference.properties["delivery_mode"] == 2


def _redis_envelopes(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return [normalised(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def _redis_publishers(redis_url: str) -> tuple[KombuPublisher, RedisPipelinePublisher]:
    app = celery.Celery("event-equivalence", broker=redis_url, set_as_current=False)
    return KombuPublisher(app, send_timeout=5), RedisPipelinePublisher(
        KombuPublisher(app, send_timeout=5)
    )


def test_event_on_redis_equals_kombus_publish_on_both_paths(
    redis_url: str, queue_name: str
) -> None:
    """On Redis the general path and the pipeline write kombu's own envelope for an event."""
    name = f"{queue_name}-events"
    exchange = Exchange(name, type="topic", durable=True)
    envelope = _envelope(subject=None, data=[1, "two", None])
    message = messages.prepare(_claimed(envelope, name, "orders.placed"), dt.datetime.now(dt.UTC))
    general, fast = _redis_publishers(redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        with Connection(redis_url) as conn:
            Queue(queue_name, exchange, routing_key="orders.*")(conn.default_channel).declare()
            _reference(conn, envelope, exchange, "orders.placed")
        assert general.publish([message], lambda: False)[0].result is Result.PUBLISHED
        with structlog.testing.capture_logs() as logs:
            assert fast.publish([message], lambda: False)[0].result is Result.PUBLISHED
        reference, via_general, via_fast_path = _redis_envelopes(client, queue_name)
    finally:
        general.close()
        fast.close()
        for key in client.keys(f"*{queue_name}*"):
            client.delete(key)
        client.close()
    assert not [e for e in logs if e["event"] == "outbox.fast_path_unavailable"]
    assert via_general == reference
    assert via_fast_path == reference
    assert base64.b64decode(reference["body"]) == wire.encode(envelope)
    assert json.loads(base64.b64decode(reference["body"]))["data"] == [1, "two", None]
    assert reference["content-type"] == wire.CONTENT_TYPE


def test_redis_pipeline_routes_a_mixed_batch_as_kombu_does(redis_url: str, queue_name: str) -> None:
    """Events fanned out by topic bindings, an unroutable event and a task in one batch: the
    pipeline fills the same lists with the same envelopes, and fails the same message."""
    name = f"{queue_name}-events"
    exchange = Exchange(name, type="topic", durable=True)
    bindings = {"a": "orders.*", "b": "#", "c": "payments.*"}
    now = dt.datetime.now(dt.UTC)
    batch = [
        messages.prepare(_claimed(_envelope(), name, "orders.placed"), now),
        messages.prepare(_claimed(_envelope(), name, "payments.done"), now),
        messages.prepare(_claimed(_envelope(), f"{name}-nobody", "orders.placed"), now),
        messages.prepare(claimed(f"{queue_name}-task"), now),
        messages.prepare(_claimed(_envelope(), name, "orders.placed"), now),
    ]
    general, fast = _redis_publishers(redis_url)
    client = redis.Redis.from_url(redis_url)
    results: dict[str, list[Result]] = {}
    lists: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        with Connection(redis_url) as conn:
            for suffix, pattern in bindings.items():
                Queue(f"{queue_name}-{suffix}", exchange, routing_key=pattern)(
                    conn.default_channel
                ).declare()
        for path, publisher in (("general", general), ("pipeline", fast)):
            with structlog.testing.capture_logs() as logs:
                results[path] = [a.result for a in publisher.publish(batch, lambda: False)]
            fallbacks = [e for e in logs if e["event"] == "outbox.fast_path_unavailable"]
            assert not fallbacks or path == "general", fallbacks
            lists[path] = {
                suffix: _redis_envelopes(client, f"{queue_name}-{suffix}")
                for suffix in (*bindings, "task")
            }
            client.delete(*(f"{queue_name}-{suffix}" for suffix in (*bindings, "task")))
    finally:
        general.close()
        fast.close()
        for key in client.keys(f"*{queue_name}*"):
            client.delete(key)
        client.close()
    published, failed = Result.PUBLISHED, Result.FAILED
    assert results["general"] == results["pipeline"] == [published] * 2 + [failed] + [published] * 2
    assert lists["pipeline"] == lists["general"]
    ids = {k: [e["headers"].get("cloudEvents_id") for e in v] for k, v in lists["general"].items()}
    first, second, _, task, third = (m.row.task_id for m in batch)
    assert ids == {"a": [first, third], "b": [first, second, third], "c": [second], "task": [None]}
    assert lists["general"]["task"][0]["headers"]["id"] == task
