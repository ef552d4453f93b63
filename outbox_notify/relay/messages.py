"""Turns a claimed row into the exact message Celery would have published.

Each `schema_version` a release has ever written has its own decoder in DECODERS, and keeps it:
rows written by an older release (still in the outbox during an upgrade, or requeued from the
dead letters) are published by this relay as they were meant. Rows of a version newer than
SCHEMA_VERSION never get here: the claim queries skip them, leaving them for a newer relay.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from kombu import Exchange
from kombu.utils import json as kombu_json

from outbox_notify import compact
from outbox_notify.exceptions import UndecodableMessage
from outbox_notify.relay import fastjson
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.serialization import (
    PublishSpec,
    decode_options,
    exchange_from_json,
    expiration_seconds,
)

JSON_CONTENT_TYPE = "application/json"
# outbox_notify.events.envelope.CONTENT_TYPE (not imported: the relay core stays Django-free,
# and the events package imports Django through its publishing side)
EVENT_CONTENT_TYPE = "application/cloudevents+json"
EVENT_ATTRIBUTES = ("specversion", "id", "source", "type", "time")
PERSISTENT = 2  # AMQP delivery mode
TYPE_TAG = '"__type__"'
PLAIN_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
PLAIN_EMBED_TEXT = kombu_json.dumps(PLAIN_EMBED)
SENTRY_HEADERS = ("sentry-trace", "baggage")


@dataclasses.dataclass(kw_only=True, slots=True)
class OutgoingMessage:
    """One message ready for the publisher, tied to the row it came from. Read-only by
    convention, not frozen: see relay/store.py's ClaimedRow."""

    row: ClaimedRow
    body: Any  # JSON text for the json serializer; (args, kwargs, embed) for any other
    spec: PublishSpec
    headers: dict[str, Any]
    expiration: float | None
    log_context: dict[str, Any]
    plain: bool  # only plain JSON types inside: the C encoder may serialise the envelope
    content_type: str = JSON_CONTENT_TYPE  # of `body` when the serializer is json


def _decode_json(text: str, what: str) -> Any:
    try:
        # kombu's decoder revives the datetimes and UUIDs it tagged at enqueue; the plain
        # decoder is several times faster and enough when nothing is tagged.
        return kombu_json.loads(text) if TYPE_TAG in text else fastjson.loads(text)
    except ValueError as exc:
        raise UndecodableMessage(f"{what} is not valid JSON: {exc}") from exc


def _body(row: ClaimedRow, spec: PublishSpec) -> Any:
    if spec.serializer == "json":
        # The stored text is already kombu's JSON: splice it instead of decoding and
        # re-encoding every argument.
        embed = PLAIN_EMBED_TEXT if spec.embed == PLAIN_EMBED else kombu_json.dumps(spec.embed)
        return f"[{row.args}, {row.kwargs}, {embed}]"
    args = kombu_json.loads(row.args)
    kwargs = kombu_json.loads(row.kwargs)
    return (args, kwargs, spec.embed)


def _headers(spec: PublishSpec, context: dict[str, Any]) -> dict[str, Any]:
    """The stored headers, plus the trace headers captured at enqueue that they lack.

    Sentry's come first, then OpenTelemetry's (`traceparent`, `tracestate`...): Celery's
    OpenTelemetry instrumentation reads them from the task request, which a worker fills from
    the message headers. A header the call or a tracing wrapper set itself is kept.
    """
    sentry = context.get("sentry") or {}
    otel = context.get("otel") or {}
    if not sentry and not otel:
        return spec.headers
    headers = dict(spec.headers)
    for key in SENTRY_HEADERS:
        if key in sentry and key not in headers:
            headers[key] = sentry[key]
    if isinstance(otel, dict):
        for key, value in otel.items():
            if isinstance(value, str) and key not in headers:
                headers[key] = value
    return headers


def _task_message(row: ClaimedRow, now: dt.datetime, decode: SpecDecoder) -> OutgoingMessage:
    """A task's message: `decode` reads its `options`; args/kwargs are kombu JSON."""
    options = _decode_json(row.options, "options")
    if not isinstance(options, dict):
        raise UndecodableMessage("options is not a JSON object")
    context = _decode_json(row.context, "context") if len(row.context) > 2 else {}
    spec = decode(options, row)
    try:
        expiration = expiration_seconds(spec.headers, now)
        body = _body(row, spec)
    except (TypeError, ValueError) as exc:
        raise UndecodableMessage(f"message cannot be built: {exc!r}") from exc
    return OutgoingMessage(
        row=row,
        body=body,
        spec=spec,
        headers=_headers(spec, context if isinstance(context, dict) else {}),
        expiration=expiration,
        plain=TYPE_TAG not in row.options,
        log_context=dict(context.get("structlog") or {}) if isinstance(context, dict) else {},
    )


SpecDecoder = Callable[[dict[str, Any], ClaimedRow], PublishSpec]


def _decode_v1(row: ClaimedRow, now: dt.datetime) -> OutgoingMessage:
    """Schema version 1: `options` is serialization.build_row's layout, everything recorded."""
    return _task_message(row, now, lambda options, _: decode_options(options))


def _decode_v2(row: ClaimedRow, now: dt.datetime) -> OutgoingMessage:
    """Schema version 2: version 1 plus `backend_calls` (made by relay/chords.py first)."""
    message = _decode_v1(row, now)
    if not message.spec.backend_calls:
        raise UndecodableMessage("a version 2 row carries no backend_calls")
    return message


def _event_exchange(value: Any) -> Exchange:
    """What a domain event's row names: a durable topic exchange, or an Exchange as given."""
    exchange = exchange_from_json(value)
    if isinstance(exchange, Exchange):
        return exchange
    if not exchange:
        raise UndecodableMessage("an event row names no exchange")
    return _topic_exchange(exchange)


_topics: dict[str, Exchange] = {}


def _topic_exchange(name: str) -> Exchange:
    exchange = _topics.get(name)
    if exchange is None:
        if len(_topics) >= 256:
            _topics.clear()
        exchange = _topics[name] = Exchange(name, type="topic", durable=True)
    return exchange


def _event_options(row: ClaimedRow) -> tuple[dict[str, Any], Exchange, str]:
    options = _decode_json(row.options, "options")
    attributes = _decode_json(row.kwargs, "the event's attributes")
    if not isinstance(options, dict) or not isinstance(options.get("headers"), dict):
        raise UndecodableMessage("an event's options must be an object with a headers object")
    if not isinstance(attributes, dict) or not all(
        isinstance(attributes.get(name), str) for name in EVENT_ATTRIBUTES
    ):
        raise UndecodableMessage(
            f"an event's attributes must include {', '.join(EVENT_ATTRIBUTES)}"
        )
    routing_key = options.get("routing_key")
    if not isinstance(routing_key, str):
        raise UndecodableMessage("an event's routing_key must be a string")
    try:
        exchange = _event_exchange(options.get("exchange"))
    except (KeyError, TypeError, ValueError) as exc:
        raise UndecodableMessage(f"an event's exchange cannot be decoded: {exc!r}") from exc
    return options["headers"], exchange, routing_key


def _decode_v3(row: ClaimedRow, now: dt.datetime) -> OutgoingMessage:
    """Schema version 3, a domain event: `args` its data, `kwargs` its other attributes.

    The body is the CloudEvents structured-mode JSON object, spliced from the stored texts
    (kombu's JSON of the attributes, then `"data"`): what `events.envelope.encode` gives.
    """
    headers, exchange, routing_key = _event_options(row)
    context = _decode_json(row.context, "context") if len(row.context) > 2 else {}
    spec = PublishSpec(
        headers=headers,
        properties={},
        embed={},
        exchange=exchange.name,
        routing_key=routing_key,
        serializer="json",
        compression=None,
        delivery_mode=PERSISTENT,
        declare_json=[],
        declare_exchange=exchange,
    )
    return OutgoingMessage(
        row=row,
        body=f'{row.kwargs.rstrip()[:-1]}, "data": {row.args}}}',
        spec=spec,
        headers=headers,
        expiration=None,
        plain=TYPE_TAG not in row.options,
        log_context=dict(context.get("structlog") or {}) if isinstance(context, dict) else {},
        content_type=EVENT_CONTENT_TYPE,
    )


def _compact_spec(options: dict[str, Any], row: ClaimedRow) -> PublishSpec:
    return compact.decode_options(options, row.task_id, row.task_name)


def _decode_v4(row: ClaimedRow, now: dt.datetime) -> OutgoingMessage:
    """Schema version 4, a task in the compact layout (compact.py): what differs from the
    defaults, the queue's declaration by name when the relay's app configures it so."""
    return _task_message(row, now, _compact_spec)


Decoder = Callable[[ClaimedRow, dt.datetime], OutgoingMessage]

# One decoder per schema_version ever released, never removed (docs/install.md, "Adding a
# schema version"); tests/integration/test_schema_versions.py publishes a frozen row of each.
DECODERS: Mapping[int, Decoder] = MappingProxyType(
    {1: _decode_v1, 2: _decode_v2, 3: _decode_v3, 4: _decode_v4}
)


def prepare(row: ClaimedRow, now: dt.datetime) -> OutgoingMessage:
    """Build the message for one row; UndecodableMessage when the row is unusable."""
    decoder = DECODERS.get(row.schema_version)
    if decoder is None:
        # Newer versions are never claimed, so this is a version no release wrote (0, -1, a
        # hand-made row): retrying cannot help.
        raise UndecodableMessage(f"unknown schema_version {row.schema_version}")
    return decoder(row, now)
