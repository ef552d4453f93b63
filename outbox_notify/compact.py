"""The compact layout of a task's `options` (schema version 4): what differs from the defaults.

Version 1 stored everything Celery recorded: every header with its null default, the
properties, the embedded canvas, and the queue's whole declaration (the sizes of both layouts,
measured: docs/concepts.md#the-stored-layout-of-a-task). Version 4 stores the same message as what differs from fixed defaults:

- `argsrepr`, `kwargsrepr`, `origin` (headers) and `reply_to` (a property): always, at the
  top level. They differ from call to call, so the template path fills them in.
- `headers`: Celery's headers whose value is not the default, then the custom headers, in
  Celery's order. The defaults are Celery's protocol 2 (`lang` "py", `task` and `id` the
  row's columns, `root_id` the task id, `retries` 0, `timelimit` [null, null], `stamps` {},
  false or null for the rest), the same in every supported Celery release.
- `properties`: the properties after `correlation_id` and `reply_to` unless they are
  `{"priority": null}`, and `correlation_id` when it is not the task id.
- `embed`, unless no callbacks, errbacks, chain or chord; `exchange` unless ""; `serializer`
  unless "json"; `compression` unless null; `delivery_mode` unless 2; `relative` unless {};
  `sent_event` and `backend_calls` as in versions 1 and 2.
- `queue`: [name, digest] when the one queue declared is the one the app's configuration
  gives (queues.py); the routing key is then the queue's name unless `routing_key` says
  otherwise. Any other declaration is stored whole in `declare`, as in version 1.

The relay rebuilds the message Celery recorded, key order included. A recorded message
whose headers or properties do not start the way Celery's protocol 2 starts them cannot be
rebuilt from defaults: it is stored in the full layout of version 1 instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from outbox_notify import queues, serialization
from outbox_notify.exceptions import UndecodableMessage

# Celery's protocol 2 headers, in the order celery.app.amqp.AMQP.as_task_v2 writes them.
HEADER_ORDER = (
    "lang",
    "task",
    "id",
    "shadow",
    "eta",
    "expires",
    "group",
    "group_index",
    "retries",
    "timelimit",
    "root_id",
    "parent_id",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "ignore_result",
    "replaced_task_nesting",
    "stamped_headers",
    "stamps",
)
# Stored at the top level: different in every call.
PER_CALL_HEADERS = ("argsrepr", "kwargsrepr", "origin")
_FIRST_PROPERTIES = ["correlation_id", "reply_to"]
DEFAULT_REST_PROPERTIES: dict[str, Any] = {"priority": None}
PLAIN_EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
DEFAULT_DELIVERY_MODE = 2  # persistent
_TASK = object()  # default: the row's task_name
_ID = object()  # default: the row's task_id
_CONSTANT_DEFAULTS: dict[str, Any] = {
    "lang": "py",
    "task": _TASK,
    "id": _ID,
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "retries": 0,
    "timelimit": [None, None],
    "root_id": _ID,
    "parent_id": None,
    "ignore_result": False,
    "replaced_task_nesting": 0,
    "stamped_headers": None,
    "stamps": {},
}


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (True == 1 == 1.0, but not in JSON)."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if kind is dict:
        return list(a) == list(b) and all(same(v, b[k]) for k, v in a.items())
    if a is None or kind is str or kind is int or kind is bool:
        return bool(a == b)
    return False  # anything else (a float: 0.0 == -0.0) is stored as it is


def _header_default(name: str, task_id: str, task_name: str) -> Any:
    default = _CONSTANT_DEFAULTS[name]
    if default is _ID:
        return task_id
    return task_name if default is _TASK else default


def header_overrides(
    headers: Mapping[str, Any], task_id: str, task_name: str
) -> dict[str, Any] | None:
    """The headers a row stores: those not at their default; None when not Celery's layout."""
    names = list(headers)
    if len(names) < len(HEADER_ORDER) or tuple(names[: len(HEADER_ORDER)]) != HEADER_ORDER:
        return None
    stored: dict[str, Any] = {}
    for index, (name, value) in enumerate(headers.items()):
        if index >= len(HEADER_ORDER):
            stored[name] = value  # a custom header
        elif name not in PER_CALL_HEADERS and not same(
            value, _header_default(name, task_id, task_name)
        ):
            stored[name] = value
    return stored


_NO_PROPERTIES: Any = object()  # the properties a row leaves out: the default ones


def stored_properties(properties: Mapping[str, Any], task_id: str) -> Any:
    """The properties a row stores (_NO_PROPERTIES for the default); None when not Celery's."""
    if list(properties)[:2] != _FIRST_PROPERTIES:
        return None
    rest = {k: v for k, v in properties.items() if k not in _FIRST_PROPERTIES}
    correlation_id = properties["correlation_id"]
    if not same(correlation_id, task_id):
        return {"correlation_id": correlation_id, **rest}
    return _NO_PROPERTIES if same(rest, DEFAULT_REST_PROPERTIES) else rest


def _routing(publish_kwargs: Mapping[str, Any], app: Any) -> tuple[dict[str, Any], str | None]:
    """The routing entries of a row, and the declare text to splice in (None: none)."""
    exchange = publish_kwargs.get("exchange")
    routing_key = publish_kwargs.get("routing_key")
    declare = publish_kwargs.get("declare")
    entries: dict[str, Any] = {}
    if type(exchange) is not str or exchange:  # an Exchange compares loosely with a str
        entries["exchange"] = serialization.exchange_to_json(exchange)
    name = queues.named(app, declare)
    if name is not None:
        entries["queue"] = list(name)
        if not same(routing_key, name[0]):
            entries["routing_key"] = routing_key
        return entries, None
    if routing_key is not None:
        entries["routing_key"] = routing_key
    return entries, serialization.declare_text(declare) if declare else None


def options_text(
    publish_kwargs: Mapping[str, Any],
    headers: Mapping[str, Any],
    embed: Any,
    relative: Mapping[str, float],
    sent_event: Mapping[str, Any] | None,
    *,
    task_id: str,
    task_name: str,
    app: Any,
) -> str | None:
    """The `options` column in the compact layout; None when it cannot hold this message."""
    overrides = header_overrides(headers, task_id, task_name)
    properties = serialization.message_properties(publish_kwargs)
    stored = stored_properties(properties, task_id)
    if overrides is None or stored is None:
        return None
    options: dict[str, Any] = {
        "argsrepr": headers["argsrepr"],
        "kwargsrepr": headers["kwargsrepr"],
        "origin": headers["origin"],
        "reply_to": properties["reply_to"],
    }
    if overrides:
        options["headers"] = overrides
    if stored is not _NO_PROPERTIES:
        options["properties"] = stored
    if not same(embed, PLAIN_EMBED):
        options["embed"] = embed
    routing, declare = _routing(publish_kwargs, app)
    options.update(routing)
    options.update(_encoding(publish_kwargs))
    if relative:
        options["relative"] = dict(relative)
    if sent_event:
        options["sent_event"] = dict(sent_event)
    text = serialization.dumps(options, "task options")
    # A declaration is spliced in as text encoded once per list of queues (declare_text).
    return text if declare is None else f'{text[:-1]}, "declare": {declare}}}'


def _encoding(publish_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Serializer, compression and delivery mode, those not at their default."""
    found = {
        "serializer": publish_kwargs.get("serializer") or "json",
        "compression": publish_kwargs.get("compression"),
        "delivery_mode": publish_kwargs.get("delivery_mode"),
    }
    return {key: value for key, value in found.items() if not same(value, _ENCODING[key])}


_ENCODING: dict[str, Any] = {
    "serializer": "json",
    "compression": None,
    "delivery_mode": DEFAULT_DELIVERY_MODE,
}


def build_row(
    body: Any,
    publish_kwargs: Mapping[str, Any],
    *,
    app: Any,
    relative: Mapping[str, float],
    context: Mapping[str, Any],
    sent_event: Mapping[str, Any] | None = None,
    hold_until: datetime | None = None,
) -> serialization.OutboxRow:
    """A recorded publish as an outbox row: compact (version 4), else in version 1's layout.

    `app` is the writer's Celery app, whose configuration says which queue declarations a
    row may leave to the relay (queues.py); with None every declaration is stored whole.
    """
    args, kwargs, embed, headers = serialization.recorded_parts(body, publish_kwargs)
    task_id, task_name = str(headers["id"]), str(headers["task"])
    version = serialization.COMPACT_VERSION
    text = options_text(
        publish_kwargs,
        headers,
        embed,
        relative,
        sent_event,
        task_id=task_id,
        task_name=task_name,
        app=app,
    )
    if text is None:
        version = serialization.DEFAULT_VERSION
        text = serialization.options_text(publish_kwargs, headers, embed, relative, sent_event)
    return serialization.OutboxRow(
        task_id=task_id,
        task_name=task_name,
        args=serialization.dumps_args(args),
        kwargs=serialization.dumps_kwargs(kwargs),
        options=text,
        context=serialization.dumps_context(context),
        hold_until=hold_until,
        schema_version=version,
    )


# --- the relay's side ------------------------------------------------------------------


def _headers(options: Mapping[str, Any], task_id: str, task_name: str) -> dict[str, Any]:
    headers = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": options["argsrepr"],
        "kwargsrepr": options["kwargsrepr"],
        "origin": options["origin"],
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    overrides = options.get("headers")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise TypeError("headers must be a JSON object")
        headers.update(overrides)
    return headers


def _properties(options: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    stored = options.get("properties", DEFAULT_REST_PROPERTIES)
    if not isinstance(stored, dict):
        raise TypeError("properties must be a JSON object")
    properties = {
        "correlation_id": stored.get("correlation_id", task_id),
        "reply_to": options["reply_to"],
    }
    for key, value in stored.items():  # no generator: read for every row a relay publishes
        if key != "correlation_id":
            properties[key] = value
    return properties


def _declared(options: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The queues to declare, and the routing key's default (the named queue's name)."""
    named = options.get("queue")
    if named is None:
        return serialization.declare_list(options.get("declare")), None
    # Read for every row a relay publishes: no generator here.
    if not (isinstance(named, list) and len(named) == 2):
        raise TypeError("queue must be [name, digest]")
    name, stored_digest = named
    if not (isinstance(name, str) and isinstance(stored_digest, str)):
        raise TypeError("queue must be [name, digest]")
    declaration = queues.declaration(name, stored_digest)
    return ([] if declaration is None else [declaration]), name


def decode_options(
    options: Mapping[str, Any], task_id: str, task_name: str
) -> serialization.PublishSpec:
    """Decode a version 4 row's `options`; UndecodableMessage when malformed."""
    try:
        embed = options.get("embed")
        if embed is not None and not isinstance(embed, dict):
            raise TypeError("embed must be a JSON object")
        declare, default_key = _declared(options)
        return serialization.PublishSpec(
            headers=_headers(options, task_id, task_name),
            properties=_properties(options, task_id),
            embed=dict(PLAIN_EMBED) if embed is None else embed,
            exchange=serialization.exchange_from_json(options.get("exchange", "")),
            routing_key=options.get("routing_key", default_key),
            serializer=options.get("serializer", "json"),
            compression=options.get("compression"),
            delivery_mode=options.get("delivery_mode", DEFAULT_DELIVERY_MODE),
            declare_json=declare,
            sent_event=serialization.sent_event_of(options.get("sent_event")),
            backend_calls=serialization.backend_calls_of(options.get("backend_calls")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UndecodableMessage(f"options cannot be decoded: {exc!r}") from exc


def decode_any(
    options: Mapping[str, Any], *, task_id: str, task_name: str, schema_version: int
) -> serialization.PublishSpec:
    """A stored task's `options` decoded, in whichever layout its version has (1, 2 or 4)."""
    if schema_version == serialization.COMPACT_VERSION:
        return decode_options(options, task_id, task_name)
    return serialization.decode_options(options)


def routing_key_of(options: Mapping[str, Any]) -> Any:
    """The routing key a stored row is published with, in any layout (for display)."""
    if "routing_key" in options:
        return options["routing_key"]
    named = options.get("queue")
    return named[0] if isinstance(named, list) and named else None
