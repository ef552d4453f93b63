"""Turns what Celery would have published into an outbox row, and a row back into a message.

The write side lets Celery's own `send_task` do all its work (task id, routing, ETA, expiry,
parent and root ids, canvas embedding, signals) against a producer that records instead of
publishing. What it recorded is stored here as JSON, and the relay later publishes exactly
that, so a worker cannot tell an outbox message from one sent directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kombu import Exchange, Queue, binding
from kombu.utils import json as kombu_json

from outbox_notify.exceptions import SerializationError, UndecodableMessage

# The layout of `options` the write side produces, and the newest the relay reads: it has a
# decoder for every version up to this one (relay/messages.py DECODERS) and leaves rows of a
# newer version alone (a newer relay will publish them).
SCHEMA_VERSION = 1

# kombu.Producer.publish keywords that are not message properties. retry/retry_policy and
# the timeouts are the relay's business, so they are dropped at capture.
_PUBLISH_ARGS = frozenset(
    {"exchange", "routing_key", "serializer", "compression", "delivery_mode", "declare", "headers"}
)
_DROPPED_ARGS = frozenset(
    {"retry", "retry_policy", "timeout", "confirm_timeout", "expiration", "mandatory", "immediate"}
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OutboxRow:
    """The columns the write side inserts for one message."""

    task_id: str
    task_name: str
    args: str  # JSON text, as kombu encodes it
    kwargs: str
    options: str
    context: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PublishSpec:
    """What the relay hands to the broker for one row, decoded from its `options`."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    embed: dict[str, Any]
    exchange: str | Exchange
    routing_key: str | None
    serializer: str
    compression: str | None
    delivery_mode: int | None
    declare_json: list[dict[str, Any]]  # queues as stored; kombu objects built on demand

    @property
    def declare(self) -> list[Queue]:
        """The queues to declare before publishing, as kombu objects (built once per shape)."""
        queues: list[Queue] = [_cached_entity("queue", q) for q in self.declare_json]
        return queues


def dumps(value: Any, what: str) -> str:
    """Encode `value` with kombu's JSON encoder, raising SerializationError when it cannot."""
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and PostgreSQL's json type would
        # reject them at INSERT, aborting the caller's transaction instead of failing the call.
        return kombu_json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(
            f"{what} cannot be stored in the outbox as JSON: {exc}. Pass JSON-serializable "
            "values (str, int, float, bool, None, list, dict, datetime, UUID, Decimal)."
        ) from exc


def seconds(value: Any) -> Any:
    """Turn a timedelta into float seconds; leave anything else as it is."""
    return value.total_seconds() if isinstance(value, timedelta) else value


def relative_times(options: Mapping[str, Any]) -> dict[str, float]:
    """The relative countdown/expires the caller gave, kept so a requeue can re-base them."""
    relative: dict[str, float] = {}
    for key in ("countdown", "expires"):
        value = seconds(options.get(key))
        if isinstance(value, int | float) and not isinstance(value, bool):
            relative[key] = float(value)
    return relative


def exchange_to_json(exchange: Any) -> Any:
    """An exchange name stays a string; an Exchange object keeps all its declaration."""
    if exchange is None or isinstance(exchange, str):
        return exchange
    return {"exchange": exchange.as_dict()}


def queue_to_json(queue: Queue) -> dict[str, Any]:
    """A kombu Queue as a JSON-able dict, including its exchange and bindings."""
    data: dict[str, Any] = queue.as_dict(recurse=True)
    return data


def build_row(
    body: Any,
    publish_kwargs: Mapping[str, Any],
    *,
    relative: Mapping[str, float],
    context: Mapping[str, Any],
) -> OutboxRow:
    """Turn a recorded `Producer.publish(body, **publish_kwargs)` call into outbox columns."""
    if not isinstance(body, tuple) or len(body) != 3:
        raise SerializationError(
            "outbox-notify stores Celery task protocol 2 messages only (task_protocol=2)"
        )
    args, kwargs, embed = body
    headers = dict(publish_kwargs.get("headers") or {})
    for what in ("id", "task"):
        if "\x00" in str(headers.get(what, "")):
            # PostgreSQL text cannot hold NUL; fail at the call, not at the INSERT.
            raise SerializationError(f"the task {what} contains a NUL character")
    properties = {
        key: value
        for key, value in publish_kwargs.items()
        if key not in _PUBLISH_ARGS and key not in _DROPPED_ARGS
    }
    options = {
        "headers": headers,
        "properties": properties,
        "embed": embed,
        "exchange": exchange_to_json(publish_kwargs.get("exchange")),
        "routing_key": publish_kwargs.get("routing_key"),
        "serializer": publish_kwargs.get("serializer") or "json",
        "compression": publish_kwargs.get("compression"),
        "delivery_mode": publish_kwargs.get("delivery_mode"),
        "declare": [queue_to_json(q) for q in publish_kwargs.get("declare") or ()],
        "relative": dict(relative),
    }
    return OutboxRow(
        task_id=str(headers["id"]),
        task_name=str(headers["task"]),
        args=dumps(list(args), "task args"),
        kwargs=dumps(dict(kwargs), "task kwargs"),
        options=dumps(options, "task options"),
        context=kombu_json.dumps(context, default=str),
    )


_ENTITY_CACHE_SIZE = 256  # distinct exchanges/queues remembered by the relay


_entities: dict[tuple[str, str], Any] = {}


def _cached_entity(kind: str, value: Any) -> Any:
    # Most messages route through the same few queues: build each kombu entity once. The
    # key is the repr of the decoded JSON, which is cheap and exact for JSON values.
    key = (kind, repr(value))
    entity = _entities.get(key)
    if entity is None:
        entity = Exchange(**value["exchange"]) if kind == "exchange" else _queue_from_json(value)
        if len(_entities) >= _ENTITY_CACHE_SIZE:
            _entities.clear()
        _entities[key] = entity
    return entity


def _exchange_from_json(value: Any) -> str | Exchange:
    if value is None or isinstance(value, str):
        return value or ""
    result: Exchange = _cached_entity("exchange", value)
    return result


def _binding_from_json(value: Mapping[str, Any]) -> binding:
    data = dict(value)
    if isinstance(data.get("exchange"), Mapping):
        data["exchange"] = Exchange(**data["exchange"])
    return binding(**data)


def _queue_from_json(value: Mapping[str, Any]) -> Queue:
    data = dict(value)
    if isinstance(data.get("exchange"), Mapping):
        data["exchange"] = Exchange(**data["exchange"])
    data["bindings"] = [_binding_from_json(b) for b in data.get("bindings") or ()]
    return Queue(**data)


def _declare_list(value: Any) -> list[dict[str, Any]]:
    queues = list(value or ())
    if not all(isinstance(q, dict) and isinstance(q.get("name"), str) for q in queues):
        raise TypeError("declare must be a list of queue objects with a name")
    return queues


def decode_options(options: Mapping[str, Any]) -> PublishSpec:
    """Decode a row's `options` (schema version 1); UndecodableMessage when it is malformed."""
    try:
        headers = options["headers"]
        properties = options.get("properties") or {}
        embed = options.get("embed") or {}
        if not isinstance(headers, dict) or not isinstance(properties, dict):
            raise TypeError("headers and properties must be JSON objects")
        if not isinstance(embed, dict):
            raise TypeError("embed must be a JSON object")
        return PublishSpec(
            headers=headers,
            properties=properties,
            embed=embed,
            exchange=_exchange_from_json(options.get("exchange")),
            routing_key=options.get("routing_key"),
            serializer=options.get("serializer") or "json",
            compression=options.get("compression"),
            delivery_mode=options.get("delivery_mode"),
            declare_json=_declare_list(options.get("declare")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UndecodableMessage(f"options cannot be decoded: {exc!r}") from exc


def expiration_seconds(headers: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds until the message expires, counted at publish time (None when it never does)."""
    expires = headers.get("expires")
    if not expires:
        return None
    moment = datetime.fromisoformat(expires) if isinstance(expires, str) else expires
    if moment.tzinfo is None and now.tzinfo is not None:
        moment = moment.replace(tzinfo=now.tzinfo)
    return max((moment - now).total_seconds(), 0.0)
