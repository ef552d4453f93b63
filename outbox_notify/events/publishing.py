"""Publishing a domain event: one outbox row in the caller's transaction, forwarded by the relay.

`publish()` turns a dataclass instance or a mapping into an `Envelope`, checks everything the
relay will need (JSON data, size, names the broker accepts), and writes one row of schema
version 3 (`EVENT_VERSION`) on the outbox database, exactly as a task's row is written: in
the caller's transaction when there is one, so a rollback means the event never existed.

The row's columns (relay/messages.py decodes them; docs/events.md shows an example):

- `task_id`: the event id; `task_name`: the event type (admin, stats, metrics, signals);
- `args`: the event's `data` as kombu's JSON (any JSON value);
- `kwargs`: every other CloudEvents attribute, as the JSON object the body starts with, so the
  relay's body is `kwargs` with `"data": args` appended, byte for byte `envelope.encode()`;
- `options`: `{"headers": {...}, "exchange": name | {"exchange": {...}}, "routing_key": ...}`,
  the headers being the binding's `cloudEvents_*` headers followed by the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kombu import Exchange

from outbox_notify import conf, limits
from outbox_notify._write import context, rows
from outbox_notify.events.envelope import HEADER_PREFIX, Envelope, binding_headers, new_event_id
from outbox_notify.exceptions import SerializationError
from outbox_notify.serialization import EVENT_VERSION, OutboxRow, dumps, exchange_to_json

__all__ = ["EventError", "event_row", "publish", "to_envelope"]

MAX_NAME_BYTES = 255  # AMQP short strings: exchange names and routing keys
MAPPING_KEYS = frozenset({"type", "data", "id", "subject", "time"})


class EventError(SerializationError, ValueError):
    """An event (or where it goes) that cannot be published; nothing was written."""


def publish(
    event: Any,
    *,
    exchange: str | Exchange,
    routing_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> Envelope:
    """Store `event` for the relay to publish to `exchange`, in the caller's transaction.

    `event` is a dataclass instance (type: its `event_type` class attribute, else
    `module.QualName`; data: `dataclasses.asdict`) or a mapping with "type" and optionally
    "data", "id", "subject", "time". A str `exchange` is a durable topic exchange of that name;
    a kombu Exchange is declared as given. `routing_key` defaults to the event's type. Returns
    the envelope the consumers will receive (its `id` is the event id).

    .. versionadded:: 0.1.0
    """
    envelope = to_envelope(event, source=conf.event_source())
    row = event_row(envelope, exchange=exchange, routing_key=routing_key, headers=headers)
    rows.insert_row(row, conf.database_alias(), None)
    return envelope


def to_envelope(event: Any, *, source: str) -> Envelope:
    """The envelope for a dataclass instance or a mapping; EventError when it is neither."""
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        return _envelope(
            {"type": _dataclass_type(type(event)), "data": dataclasses.asdict(event)}, source
        )
    if isinstance(event, Mapping):
        return _envelope(event, source)
    raise EventError(
        "an event is a dataclass instance or a mapping with a 'type', not "
        f"{type(event).__name__}: {event!r:.80}"
    )


def _dataclass_type(cls: type) -> str:
    declared = getattr(cls, "event_type", None)
    if declared is None:
        return f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(declared, str):
        raise EventError(f"{cls.__qualname__}.event_type must be a str, not {declared!r:.80}")
    return declared


def _envelope(event: Mapping[str, Any], source: str) -> Envelope:
    unknown = sorted(map(str, set(event) - MAPPING_KEYS))
    if unknown:
        raise EventError(
            f"unknown event key(s) {', '.join(unknown)}; an event mapping has 'type' and "
            "optionally 'data', 'id', 'subject', 'time'"
        )
    if "type" not in event:
        raise EventError("an event mapping needs an explicit 'type' (a non-empty str)")
    subject = event.get("subject")
    return Envelope(
        id=new_event_id() if event.get("id") is None else _text(event["id"], "id"),
        source=source,
        type=_text(event["type"], "type"),
        time=_time(event.get("time")),
        data=event.get("data"),
        subject=None if subject is None else _text(subject, "subject"),
    )


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise EventError(f"the event's {what} must be a non-empty str, not {value!r:.80}")
    if "\x00" in value:
        raise EventError(f"the event's {what} contains a NUL character")
    return value


def _time(value: Any) -> datetime:
    if value is None:
        return datetime.now(UTC)
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise EventError(f"the event's time must be a timezone-aware datetime, not {value!r:.80}")
    return value.astimezone(UTC)


def event_row(
    envelope: Envelope,
    *,
    exchange: str | Exchange,
    routing_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> OutboxRow:
    """The outbox row (schema version 3) for one envelope; EventError when it cannot be sent."""
    attributes = envelope.attributes()
    data = attributes.pop("data")
    key = envelope.type if routing_key is None else routing_key
    options = {
        "headers": {**binding_headers(envelope), **_user_headers(headers)},
        "exchange": exchange_to_json(_exchange(exchange)),
        "routing_key": _name(key, "routing key"),
    }
    try:
        row = OutboxRow(
            task_id=envelope.id,
            task_name=envelope.type,
            args=dumps(data, f"the data of event {envelope.type!r}"),
            kwargs=dumps(attributes, f"the attributes of event {envelope.type!r}"),
            options=dumps(
                options, f"the exchange, routing key or headers of event {envelope.type!r}"
            ),
            context=_context(),
            schema_version=EVENT_VERSION,
        )
        limits.check_message_size(row.task_name, row.args, row.kwargs, row.options, kind="event")
    except EventError:
        raise
    except SerializationError as exc:
        # One error class for everything wrong with an event (docs/events.md): EventError is
        # a SerializationError and a ValueError, so every documented `except` catches it.
        raise EventError(str(exc)) from exc
    return row


def _context() -> str:
    # Only structlog's context: the relay binds it while it publishes the event (its logs
    # then carry the request id that produced the event).
    captured = context.capture(sentry=False)
    return dumps(captured, "the event's log context") if captured else "{}"


def _exchange(exchange: Any) -> str | Exchange:
    if isinstance(exchange, Exchange):
        _name(exchange.name, "exchange name", empty=False)
        return exchange
    if isinstance(exchange, str):
        return _name(exchange, "exchange name", empty=False)
    raise EventError(f"exchange must be a str or a kombu.Exchange, not {exchange!r:.80}")


def _name(value: Any, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise EventError(
            f"the {what} must be a {'' if empty else 'non-empty '}str, not {value!r:.80}"
        )
    if "\x00" in value or len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise EventError(f"the {what} {value!r:.80} has a NUL or is over {MAX_NAME_BYTES} bytes")
    return value


def _user_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise EventError(f"headers must be a mapping, not {headers!r:.80}")
    for name in headers:
        if not isinstance(name, str) or not name:
            raise EventError(f"header names must be non-empty str, not {name!r:.80}")
        if name.startswith(HEADER_PREFIX):
            raise EventError(
                f"header {name!r}: the {HEADER_PREFIX}* headers mirror the event's attributes "
                "and are set by outbox-notify"
            )
    return dict(headers)
