"""Turns what Celery would have published into an outbox row, and a row back into a message.

The write side lets Celery's own `send_task` do all its work (task id, routing, ETA, expiry,
parent and root ids, canvas embedding, signals) against a producer that records instead of
publishing. What it recorded is stored here as JSON, and the relay later publishes exactly
that, so a worker cannot tell an outbox message from one sent directly.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from json import encoder as json_encoder
from typing import Any

from kombu import Exchange, Queue, binding
from kombu.utils import json as kombu_json

from outbox_notify import limits
from outbox_notify.exceptions import (
    ConfigurationError,
    SerializationError,
    UndecodableMessage,
)

# The newest layout of `options` the relay reads: it has a decoder for every version up to
# this one (relay/messages.py DECODERS) and leaves rows of a newer version alone (a newer relay
# will publish them).
SCHEMA_VERSION = 4
# Version 1: everything Celery recorded (build_row below). Every relay reads it; the writer
# stores it only for a message the compact layout cannot hold (compact.py).
DEFAULT_VERSION = 1
# Version 2 is version 1 plus `backend_calls`: result-backend calls (a chord's size) the relay
# makes before it publishes the row (_chord_calls.py); a relay that predates them must not take it.
BACKEND_CALLS_VERSION = 2
# Version 3 is a domain event (outbox_notify.events.publishing): `args` holds the event's data,
# `kwargs` its other CloudEvents attributes, `options` its exchange, routing key and headers.
EVENT_VERSION = 3
# Version 4 is a task in the compact layout (compact.py): only what differs from Celery's
# defaults, and the queue by name when the app's configuration declares it so; it may carry
# `backend_calls` too. What the writer stores for a task.
COMPACT_VERSION = 4

# kombu.Producer.publish keywords that are not message properties. retry/retry_policy and
# the timeouts are the relay's business, so they are dropped at capture.
_PUBLISH_ARGS = frozenset(
    {"exchange", "routing_key", "serializer", "compression", "delivery_mode", "declare", "headers"}
)
_DROPPED_ARGS = frozenset(
    {"retry", "retry_policy", "timeout", "confirm_timeout", "expiration", "mandatory", "immediate"}
)
PROTOCOL_1_MESSAGE = (
    "outbox-notify stores Celery task protocol 2 messages only: remove task_protocol=1 "
    "from the Celery configuration (protocol 2 is Celery's default since 4.0)"
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
    # Stored in retry_after: the ETA of a task held in the outbox until it is due (held.py).
    hold_until: datetime | None = None
    schema_version: int = DEFAULT_VERSION


def with_backend_calls(row: OutboxRow, calls: list[dict[str, Any]]) -> OutboxRow:
    """`row` carrying result-backend calls for the relay to make before publishing it."""
    encoded = dumps(calls, "the chord's result-backend calls")
    options = f'{row.options[:-1]}, "backend_calls": {encoded}}}'
    # A compact row reads its backend_calls as it is; a row in version 1's layout becomes 2.
    version = COMPACT_VERSION if row.schema_version == COMPACT_VERSION else BACKEND_CALLS_VERSION
    return dataclasses.replace(row, options=options, schema_version=version)


def new_id() -> str:
    """A fresh unique id (for recorded calls the relay makes once)."""
    return uuid.uuid4().hex


@dataclasses.dataclass(kw_only=True, slots=True)
class PublishSpec:
    """What the relay hands to the broker for one row, decoded from its `options`. Read-only
    by convention, not frozen: see relay/store.py's ClaimedRow."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    embed: dict[str, Any]
    exchange: str | Exchange
    routing_key: str | None
    serializer: str
    compression: str | None
    delivery_mode: int | None
    declare_json: list[dict[str, Any]]  # queues as stored; kombu objects built on demand
    # Fields of the `task-sent` event to publish once the task is out (task_send_sent_event).
    sent_event: dict[str, Any] | None = None
    # Result-backend calls to make before the message goes out (schema version 2, _chord_calls.py).
    backend_calls: list[dict[str, Any]] | None = None
    # An exchange to declare (once per connection) before publishing: a domain event's.
    declare_exchange: Exchange | None = None

    @property
    def declare(self) -> list[Queue]:
        """The queues to declare before publishing, as kombu objects (built once per shape)."""
        queues: list[Queue] = [_cached_entity("queue", q) for q in self.declare_json]
        return queues


# One encoder each, built once: `kombu_json.dumps(value, allow_nan=False)` builds the same
# encoder on every call, and the enqueue path encodes three values per task.
_ENCODER = kombu_json.JSONEncoder(allow_nan=False)
_CONTEXT_ENCODER = kombu_json.JSONEncoder(default=str)


def _one_shot_encoder() -> Any:
    """The C encoder `_ENCODER.encode()` builds on every call, built once (None without it).

    It skips the circular-reference check (markers=None): a value it cannot encode, circular
    or not, is encoded again by `_ENCODER` itself, which raises the usual error.
    """
    make = getattr(json_encoder, "c_make_encoder", None)
    base = json_encoder.JSONEncoder
    kind = type(_ENCODER)
    if make is None or kind.encode is not base.encode or kind.iterencode is not base.iterencode:
        return None
    if _ENCODER.indent is not None or not _ENCODER.ensure_ascii:
        return None
    try:
        encoder = make(
            None,
            _ENCODER.default,
            json_encoder.encode_basestring_ascii,
            None,
            _ENCODER.key_separator,
            _ENCODER.item_separator,
            _ENCODER.sort_keys,
            _ENCODER.skipkeys,
            _ENCODER.allow_nan,
        )
        sample = {"a": [1, 2.5, None, True, "é\n"], "b": {"c": ""}}
        if "".join(encoder(sample, 0)) != _ENCODER.encode(sample):
            return None
    except Exception:  # a Python whose C encoder takes other arguments
        return None
    return encoder


_ONE_SHOT = _one_shot_encoder()


def dumps_quick(value: Any, what: str) -> str:
    """`dumps()` for a list or dict of task arguments, through the prebuilt C encoder."""
    if _ONE_SHOT is not None:
        try:
            return "".join(_ONE_SHOT(value, 0))
        except Exception:  # noqa: S110 - encoded again below, raising the usual error
            pass
    return dumps(value, what)


def dumps(value: Any, what: str) -> str:
    """Encode `value` with kombu's JSON encoder, raising SerializationError when it cannot."""
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and PostgreSQL's json type would
        # reject them at INSERT, aborting the caller's transaction instead of failing the call.
        return _ENCODER.encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise SerializationError(
            f"{what} cannot be stored in the outbox as JSON: {exc}. Pass JSON-serializable "
            "values (str, int, float, bool, None, list, dict, datetime, UUID, Decimal)."
        ) from exc


def dumps_args(args: Any) -> str:
    """Positional task arguments as stored (a JSON array, whatever sequence was given)."""
    if not args:
        return "[]"
    return dumps_quick(args if type(args) is list else list(args), "task args")


def dumps_kwargs(kwargs: Any) -> str:
    """Keyword task arguments as stored (a JSON object, whatever mapping was given)."""
    if not kwargs:
        return "{}"
    return dumps_quick(kwargs if type(kwargs) is dict else dict(kwargs), "task kwargs")


def dumps_context(context: Mapping[str, Any]) -> str:
    """Encode the captured context; whatever JSON cannot hold is stored as its str()."""
    return _CONTEXT_ENCODER.encode(context) if context else "{}"


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


_DECLARE_CACHE_SIZE = 256  # distinct declare lists remembered by the write side
_declare_texts: dict[tuple[int, ...], tuple[tuple[Queue, ...], str]] = {}


def declare_text(declare: Any) -> str:
    """The JSON text of the queues to declare, encoded once per list of Queue objects.

    Celery hands the same Queue objects (from `app.amqp.queues`) to every publish, and
    turning one into JSON walks its exchange and bindings: worth doing once.
    """
    queues = tuple(declare or ())
    key = tuple(map(id, queues))
    cached = _declare_texts.get(key)
    # The objects are kept with the text, so an id reused by a new object cannot match.
    if cached is not None and all(a is b for a, b in zip(cached[0], queues, strict=True)):
        return cached[1]
    text = dumps([queue_to_json(q) for q in queues], "the queues to declare")
    if len(_declare_texts) >= _DECLARE_CACHE_SIZE:
        _declare_texts.clear()
    _declare_texts[key] = (queues, text)
    return text


def validate_row(row: OutboxRow) -> None:
    """Every check a row passes before it is inserted, single or bulk: the one place for them.

    Raises SerializationError (inside the caller's transaction, before anything is written).
    """
    # PostgreSQL text cannot hold NUL; fail at the call, not at the INSERT.
    if "\x00" in row.task_id:
        raise SerializationError("the task id contains a NUL character")
    if "\x00" in row.task_name:
        raise SerializationError("the task name contains a NUL character")
    if row.hold_until is not None and row.hold_until.tzinfo is None:
        # A naive time would be read in the database session's time zone, not the ETA's.
        raise SerializationError("the time a task is held until must carry a time zone")
    limits.check_message_size(row.task_name, row.args, row.kwargs, row.options)


def message_properties(publish_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The message properties of a recorded publish (its other keywords are not properties)."""
    return {
        key: value
        for key, value in publish_kwargs.items()
        if key not in _PUBLISH_ARGS and key not in _DROPPED_ARGS
    }


def options_text(
    publish_kwargs: Mapping[str, Any],
    headers: Mapping[str, Any],
    embed: Any,
    relative: Mapping[str, float],
    sent_event: Mapping[str, Any] | None,
) -> str:
    """The `options` column for one recorded publish in version 1's layout (everything)."""
    options: dict[str, Any] = {
        "headers": headers,
        "properties": message_properties(publish_kwargs),
        "embed": embed,
        "exchange": exchange_to_json(publish_kwargs.get("exchange")),
        "routing_key": publish_kwargs.get("routing_key"),
        "serializer": publish_kwargs.get("serializer") or "json",
        "compression": publish_kwargs.get("compression"),
        "delivery_mode": publish_kwargs.get("delivery_mode"),
        "relative": dict(relative),
    }
    if sent_event:
        options["sent_event"] = dict(sent_event)
    text = dumps(options, "task options")
    # The declare list is spliced in as text encoded once (see declare_text).
    return f'{text[:-1]}, "declare": {declare_text(publish_kwargs.get("declare"))}}}'


def recorded_parts(body: Any, publish_kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(args, kwargs, embed, headers) of a recorded protocol 2 publish."""
    if not isinstance(body, tuple) or len(body) != 3:
        raise ConfigurationError(PROTOCOL_1_MESSAGE)
    args, kwargs, embed = body
    return args, kwargs, embed, publish_kwargs.get("headers") or {}


def build_row(
    body: Any,
    publish_kwargs: Mapping[str, Any],
    *,
    relative: Mapping[str, float],
    context: Mapping[str, Any],
    sent_event: Mapping[str, Any] | None = None,
    hold_until: datetime | None = None,
) -> OutboxRow:
    """Turn a recorded `Producer.publish(body, **publish_kwargs)` call into outbox columns,
    in version 1's layout (the writer stores compact.build_row's, version 4).

    `sent_event` holds the fields of the `task-sent` event Celery would have published with
    the message (when `task_send_sent_event` is on); the relay publishes it after the task.
    `hold_until` is the ETA a task is held in the outbox until (held.hold_until), if any.
    """
    args, kwargs, embed, headers = recorded_parts(body, publish_kwargs)
    return OutboxRow(
        task_id=str(headers["id"]),
        task_name=str(headers["task"]),
        args=dumps_args(args),
        kwargs=dumps_kwargs(kwargs),
        options=options_text(publish_kwargs, headers, embed, relative, sent_event),
        context=dumps_context(context),
        hold_until=hold_until,
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


def exchange_from_json(value: Any) -> str | Exchange:
    """An exchange as exchange_to_json stored it: a name, or the Exchange (built once)."""
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


def declare_list(value: Any) -> list[dict[str, Any]]:
    queues = list(value or ())
    if not all(isinstance(q, dict) and isinstance(q.get("name"), str) for q in queues):
        raise TypeError("declare must be a list of queue objects with a name")
    return queues


def sent_event_of(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError("sent_event must be a JSON object")
    return value


def backend_calls_of(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(c, dict) and isinstance(c.get("call"), str) and isinstance(c.get("args"), list)
        for c in value
    ):
        raise TypeError("backend_calls must be a list of calls with a name and arguments")
    return value


def decode_options(options: Mapping[str, Any]) -> PublishSpec:
    """Decode a row's `options` in version 1's layout (schema version 1 or 2);
    UndecodableMessage when malformed (compact.decode_options reads version 4)."""
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
            exchange=exchange_from_json(options.get("exchange")),
            routing_key=options.get("routing_key"),
            serializer=options.get("serializer") or "json",
            compression=options.get("compression"),
            delivery_mode=options.get("delivery_mode"),
            declare_json=declare_list(options.get("declare")),
            sent_event=sent_event_of(options.get("sent_event")),
            backend_calls=backend_calls_of(options.get("backend_calls")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UndecodableMessage(f"options cannot be decoded: {exc!r}") from exc


def header_time(value: str | datetime) -> datetime:
    """An `eta` or `expires` header as an aware datetime, meaning what it means to the worker.

    Celery writes a naive datetime given as `eta` or `expires` into the message as it is, and
    its worker reads a naive header as UTC (`maybe_make_aware`, `naive_as_utc`), whatever the
    app's `timezone` (Celery 5.3 to 5.7). ValueError or TypeError when it is not a time.
    """
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    if not isinstance(moment, datetime):
        raise TypeError(f"not a time: {value!r:.80}")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def expiration_seconds(headers: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds until the message expires, counted at publish time (None when it never does)."""
    expires = headers.get("expires")
    if not expires:
        return None
    return max((header_time(expires) - now).total_seconds(), 0.0)
