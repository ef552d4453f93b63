"""Helpers for events consumer tests: publish events as the relay does, read dead letters.

`publish_event` sends exactly what the relay sends for an event: body `encode(envelope)`,
content type `application/cloudevents+json`, UTF-8, `binding_headers(envelope)` plus user
headers, persistent, to a durable topic exchange, routing key = the event type unless given.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import kombu

from outbox_notify.events import envelope as wire
from outbox_notify.events.consumer import Consumer, event_type_of

SOURCE = "/tests/events"


def envelope_for(event: Any, *, event_id: str | None = None) -> wire.Envelope:
    """The envelope the publisher makes for a dataclass instance."""
    return wire.Envelope(
        id=event_id or wire.new_event_id(),
        source=SOURCE,
        type=event_type_of(type(event)),
        time=datetime.now(UTC),
        data=dataclasses.asdict(event),
    )


def raw_envelope(event_type: str, data: Any, *, event_id: str | None = None) -> wire.Envelope:
    """An envelope for a type string and JSON data."""
    return wire.Envelope(
        id=event_id or wire.new_event_id(),
        source=SOURCE,
        type=event_type,
        time=datetime.now(UTC),
        data=data,
    )


def exchange(name: str) -> kombu.Exchange:
    return kombu.Exchange(name, type="topic", durable=True)


def publish_event(
    url: str,
    exchange_name: str,
    envelope: wire.Envelope,
    *,
    routing_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> None:
    """Publish one event exactly as the relay does."""
    publish_body(
        url,
        exchange_name,
        wire.encode(envelope),
        routing_key=routing_key or envelope.type,
        headers={**wire.binding_headers(envelope), **(headers or {})},
    )


def publish_body(
    url: str,
    exchange_name: str,
    body: bytes,
    *,
    routing_key: str,
    headers: Mapping[str, Any] | None = None,
    content_type: str = wire.CONTENT_TYPE,
) -> None:
    """Publish any body (a broken one too) with the relay's message properties."""
    target = exchange(exchange_name)
    with kombu.Connection(url) as connection:
        producer = kombu.Producer(connection.default_channel)
        producer.publish(
            body,
            exchange=target,
            routing_key=routing_key,
            headers=dict(headers or {}),
            content_type=content_type,
            content_encoding="utf-8",
            delivery_mode=2,
            declare=[target],
            retry=False,
        )


def declare(url: str, consumer: Consumer) -> None:
    """Declare the consumer's queue and dead-letter queue, so events published now are kept."""
    from outbox_notify.events.delivery import declare as declare_topology

    with kombu.Connection(url) as connection:
        declare_topology(consumer, connection.default_channel)


def dead_letters(url: str, consumer: Consumer) -> list[kombu.Message]:
    """Take every message from the consumer's dead-letter queue (acknowledged)."""
    return list(_take(url, consumer.dead_letter_exchange))


def queued(url: str, name: str) -> int:
    """How many messages a queue holds (ready ones)."""
    with kombu.Connection(url) as connection:
        queue = kombu.Queue(name, durable=True, channel=connection.default_channel)
        _, count, _ = queue.queue_declare()  # Redis knows no empty queue: declare, not passive
        return int(count)


def _take(url: str, name: str) -> Iterator[kombu.Message]:
    with kombu.Connection(url) as connection:
        queue = kombu.Queue(name, durable=True, channel=connection.default_channel)
        while (message := queue.get(no_ack=True)) is not None:
            yield message


def remove(url: str, consumer: Consumer) -> None:
    """Delete the consumer's queues and exchanges from the broker."""
    with kombu.Connection(url) as connection:
        channel = connection.default_channel
        for name in (consumer.queue, consumer.dead_letter_exchange):
            kombu.Queue(name, channel=channel).delete()
        for name in (consumer.exchange, consumer.dead_letter_exchange):
            kombu.Exchange(name, type="topic", channel=channel).delete()


def unique_names() -> dict[str, str]:
    """Environment naming a fresh exchange, queue and consumer for one test."""
    tag = uuid.uuid4().hex[:10]
    return {
        "OUTBOX_TEST_EVENTS_NAME": f"tests-events-{tag}",
        "OUTBOX_TEST_EVENTS_EXCHANGE": f"tests-events-x-{tag}",
        "OUTBOX_TEST_EVENTS_QUEUE": f"tests-events-q-{tag}",
    }
