"""An events Consumer's dead letters: list them, replay them (`manage.py outbox_consume_dead`).

Dead letters wait in the broker, in the durable queue named after the consumer's dead-letter
exchange (delivery.py). Both operations take messages from it one by one without
acknowledging them:

- listing hands every message it read back to the queue (basic.reject with requeue) once it
  has read them, so nothing is removed. RabbitMQ puts them back where they were; kombu's
  Redis transport puts them back at the end of the queue, in the order they were read.
- replaying publishes a chosen message to the consumer's own queue (through the default
  exchange, as a retry is), with the dead-letter and retry headers removed so it starts
  again at attempt 1, confirmed by RabbitMQ; only then is the dead letter acknowledged. A
  crash in between leaves both copies: the inbox runs the handler's effects once. Messages
  not chosen go back to the queue as listing leaves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator
from typing import Any

import kombu
import structlog
from kombu.message import Message

from outbox_notify import redaction
from outbox_notify.events.consumer import Consumer, _known
from outbox_notify.events.delivery import (
    DEAD_AT,
    DEAD_ATTEMPTS,
    DEAD_CONSUMER,
    DEAD_KIND,
    DEAD_QUEUE,
    DEAD_REASON,
    ORIGINAL_EXCHANGE,
    ORIGINAL_ROUTING_KEY,
    RETRY_HEADERS,
    Runner,
    declare,
)

log = structlog.get_logger("outbox_notify")

DEAD_HEADERS = (DEAD_REASON, DEAD_KIND, DEAD_ATTEMPTS, DEAD_CONSUMER, DEAD_QUEUE, DEAD_AT)
DATA_LIMIT = 120  # characters of an event's data shown


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeadEvent:
    """One dead letter as listed; its data redacted as the admin shows an event's."""

    event_id: str | None  # None: the body was not a CloudEvent with an id
    event_type: str | None
    kind: str  # "undecodable" or "handler-failed"
    attempts: int
    dead_at: str
    reason: str
    original_exchange: str
    original_routing_key: str
    data: str

    def as_dict(self) -> dict[str, Any]:
        """The dead letter as `--format json` prints it."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Replayed:
    """What a replay did: the event ids sent back to the consumer's queue, and those not found."""

    replayed: tuple[str | None, ...]
    missing: tuple[str, ...]


def _headers(message: Message) -> dict[str, Any]:
    return dict(message.headers or {})


def _data(body: bytes | str, event_type: str | None) -> str:
    from kombu.utils import json as kombu_json

    try:
        parsed = kombu_json.loads(body)
    except Exception:  # an undecodable body: say so, show nothing of it
        return "<not JSON>"
    if not isinstance(parsed, dict) or "data" not in parsed:
        return "<not a CloudEvent>"
    return redaction.display_event(event_type or "", parsed["data"], DATA_LIMIT)


def describe(message: Message) -> DeadEvent:
    """A dead letter's event id, type, why it died and its (redacted) data."""
    headers = _headers(message)
    body = message.body or b""
    event_id, event_type = _known(body)
    return DeadEvent(
        event_id=event_id,
        event_type=event_type,
        kind=str(headers.get(DEAD_KIND, "")),
        attempts=int(headers.get(DEAD_ATTEMPTS) or 0),
        dead_at=str(headers.get(DEAD_AT, "")),
        reason=str(headers.get(DEAD_REASON, "")),
        original_exchange=str(headers.get(ORIGINAL_EXCHANGE, "")),
        original_routing_key=str(headers.get(ORIGINAL_ROUTING_KEY, "")),
        data=_data(body, event_type),
    )


@contextlib.contextmanager
def _taking(consumer: Consumer) -> Iterator[tuple[kombu.Connection, Iterator[Message]]]:
    """Messages of the dead-letter queue, unacknowledged; those not settled go back at the end."""
    runner = Runner(consumer)
    held: list[Message] = []
    with runner.connection() as connection:
        channel = connection.channel()
        # As the consumer declares them. kombu's Redis transport routes a message handed back
        # through the dead-letter exchange's bindings, by the exchange type this process
        # declared: undeclared, it would route none of them back to the queue.
        declare(consumer, channel)
        queue = kombu.Queue(consumer.dead_letter_exchange, durable=True, channel=channel)

        def messages() -> Iterator[Message]:
            while (message := queue.get(no_ack=False)) is not None:
                held.append(message)
                yield message

        try:
            yield connection, messages()
        finally:
            for message in held:
                if not message.acknowledged:
                    message.requeue()


def list_dead(consumer: Consumer, *, limit: int) -> list[DeadEvent]:
    """Up to `limit` dead letters, oldest first; all of them stay in the queue."""
    found: list[DeadEvent] = []
    with _taking(consumer) as (_, messages):
        for message in messages:
            found.append(describe(message))
            if len(found) >= limit:
                break
    return found


def _replay_headers(message: Message) -> dict[str, Any]:
    headers = _headers(message)
    for name in (*DEAD_HEADERS, *RETRY_HEADERS):
        headers.pop(name, None)
    return headers


def replay(consumer: Consumer, *, ids: Collection[str] | None = None) -> Replayed:
    """Send the dead letters with these event ids (all of them when None) back to the consumer.

    Each goes to the consumer's own queue, headers as first published (attempt 1 again),
    persistent and confirmed by RabbitMQ; then the dead letter is acknowledged.
    """
    wanted = None if ids is None else set(ids)
    replayed: list[str | None] = []
    with _taking(consumer) as (connection, messages):
        producer = kombu.Producer(connection.default_channel)
        for message in messages:
            event_id, event_type = _known(message.body or b"")
            if wanted is not None and event_id not in wanted:
                continue
            producer.publish(
                message.body,
                exchange="",
                routing_key=consumer.queue,
                headers=_replay_headers(message),
                content_type=message.content_type or "application/octet-stream",
                content_encoding=message.content_encoding or "binary",
                delivery_mode=2,
                retry=False,
            )
            message.ack()
            replayed.append(event_id)
            log.info(
                "outbox.event_replayed",
                consumer=consumer.name,
                event_id=event_id,
                event_type=event_type,
            )
    missing = () if wanted is None else tuple(sorted(wanted.difference(replayed)))
    return Replayed(replayed=tuple(replayed), missing=missing)
