"""The bulk fast path: later calls of one shape reuse what Celery built for the first.

Inside a bulk block, the first call of a task with a given set of options goes through
Celery's own `send_task` (routing, headers, properties, everything). Its stored `options`
text becomes a template whose only holes are what Celery computes per call: the task id
(also the correlation id, and the root id of a top-level task), `argsrepr`, `kwargsrepr`
and the group index. Later calls fill the holes with Celery's own functions (`uuid`,
`saferepr`) and return the same `AsyncResult` Celery would.

A shape is used only when nothing else could differ between two calls: no ETA, countdown,
expiry, links, chain, chord, custom headers or stamps; routes that map names to queues (no
router functions, which see the arguments); no publish signal receivers and no `task-sent`
events (they see or carry each message). Anything else takes Celery's full path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import signals as celery_signals
from celery.app.routes import MapRoute
from celery.utils.saferepr import saferepr
from kombu.utils.uuid import uuid

from outbox_notify import context, serialization, writeconf

# Celery options that are computed per call; everything else is part of the shape.
_PER_CALL = frozenset({"task_id", "group_index", "producer", "publisher", "connection"})
# Options under which two calls can differ in more than the holes: the full path.
_FULL_PATH = frozenset(
    {
        "countdown",
        "eta",
        "expires",
        "link",
        "link_error",
        "chain",
        "chord",
        "headers",
        "stamped_headers",
        "argsrepr",
        "kwargsrepr",
        "router",
        "route_name",
    }
)
_SIGNALS = (
    celery_signals.before_task_publish,
    celery_signals.after_task_publish,
    celery_signals.task_sent,
)
_SHAPE_CACHE_SIZE = 256  # distinct shapes remembered by one bulk block

# Stand-ins for the holes while the template is encoded. NUL never survives validation in
# a task name or id, so these cannot collide with anything else in the text.
_HOLES = {
    "id": "\x00outbox-id\x00",
    "argsrepr": "\x00outbox-argsrepr\x00",
    "kwargsrepr": "\x00outbox-kwargsrepr\x00",
    "group_index": "\x00outbox-group-index\x00",
}
_ENCODED_HOLES = {encode_basestring_ascii(v): k for k, v in _HOLES.items()}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Template:
    """The first message of a shape, with holes where later calls differ."""

    name: str
    pieces: tuple[str, ...]  # the options text between the holes
    holes: tuple[str, ...]  # which hole follows each piece but the last
    result_cls: Any
    ignored: Any
    add_to_parent: bool
    repr_maxsize: int
    kwrepr_maxsize: int
    repr_maxlevels: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    """One send_task call as an OutboxCelery app received it."""

    app: Any
    name: str
    args: Any
    kwargs: Any
    options: dict[str, Any]


class Shapes:
    """The templates of one bulk block."""

    def __init__(self) -> None:
        self.templates: dict[Any, Template | None] = {}
        # Per app: may its calls be templated at all (configuration, routes)? Read once per
        # bulk block; a block is too short-lived to see the app reconfigured.
        self.apps: dict[int, bool] = {}

    def enqueue(
        self, call: Call, settings: writeconf.WriteSettings
    ) -> tuple[Any, serialization.OutboxRow] | None:
        """(AsyncResult, row) for a call of a known shape; None when Celery must build it."""
        app_ok = self.apps.get(id(call.app))
        if app_ok is None:
            app_ok = self.apps[id(call.app)] = _app_eligible(call.app)
        key = _shape_key(call) if app_ok and _eligible(call) else None
        if key is None:
            return None
        template = self.templates.get(key, _MISSING)
        if template is None:
            return None  # this shape cannot be templated: the caller takes the full path
        if template is _MISSING:
            return self._first(key, call, settings)
        assert isinstance(template, Template)
        return _fill(template, call, settings)

    def _first(
        self, key: Any, call: Call, settings: writeconf.WriteSettings
    ) -> tuple[Any, serialization.OutboxRow]:
        parent = call.app.current_worker_task
        recorder, result = call.app.recorded_send(
            call.name, call.args, call.kwargs, dict(call.options)
        )
        row = call.app.row_from(recorder, {}, settings)
        if len(self.templates) >= _SHAPE_CACHE_SIZE:
            self.templates.clear()
        self.templates[key] = _template(call, recorder, parent)
        return result, row


_MISSING: Any = object()


def _eligible(call: Call) -> bool:
    """Whether nothing but the holes can differ between two calls of this shape."""
    if not isinstance(call.args, list | tuple | None):
        return False  # Celery raises its own TypeError on the full path
    if not isinstance(call.kwargs, Mapping | None):
        return False
    if any(call.options.get(k) is not None for k in _FULL_PATH):
        return False
    return not any(signal.receivers for signal in _SIGNALS)


def _app_eligible(app: Any) -> bool:
    """Whether the app's configuration lets two calls of one shape differ only in the holes."""
    conf = app.conf
    if conf.task_send_sent_event or conf.task_protocol != 2:
        return False
    return all(isinstance(route, MapRoute) for route in app.amqp.router.routes)


def _shape_key(call: Call) -> Any:
    parent = call.app.current_worker_task
    items = tuple((k, v) for k, v in call.options.items() if k not in _PER_CALL)
    key = (id(call.app), call.name, parent.request.id if parent is not None else None, items)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _template(call: Call, recorder: Any, parent: Any) -> Template | None:
    options = call.options
    given = {k: options.get(k) for k in ("task_id", "group_index")}
    body, publish_kwargs = recorder.recorded
    if recorder.sent_event is not None or not isinstance(body, tuple):
        return None
    headers = dict(publish_kwargs["headers"])
    task_id = headers["id"]
    if headers.get("root_id") == task_id:
        headers["root_id"] = _HOLES["id"]
    elif given["task_id"] is not None and task_id in (
        headers.get("root_id"),
        headers.get("parent_id"),
    ):
        return None  # a caller-chosen id that also names the root or parent: too clever
    headers.update(id=_HOLES["id"], argsrepr=_HOLES["argsrepr"], kwargsrepr=_HOLES["kwargsrepr"])
    if given["group_index"] is not None:
        headers["group_index"] = _HOLES["group_index"]
    kwargs = dict(publish_kwargs, headers=headers, correlation_id=_HOLES["id"])
    text = serialization.options_text(kwargs, headers, body[2], {}, None)
    pieces, holes = _split(text)
    if pieces is None or task_id in text:
        return None
    amqp, conf = call.app.amqp, call.app.conf
    return Template(
        name=call.name,
        pieces=pieces,
        holes=holes,
        result_cls=options.get("result_cls") or call.app.AsyncResult,
        ignored=options.get("ignore_result"),
        add_to_parent=bool(options.get("add_to_parent", True)) and parent is not None,
        repr_maxsize=amqp.argsrepr_maxsize,
        kwrepr_maxsize=amqp.kwargsrepr_maxsize,
        repr_maxlevels=conf.task_repr_maxlevels,
    )


def _split(text: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    pieces: list[str] = []
    holes: list[str] = []
    rest = text
    while True:
        found = [(rest.find(enc), enc) for enc in _ENCODED_HOLES if enc in rest]
        if not found:
            break
        position, encoded = min(found)
        pieces.append(rest[:position])
        holes.append(_ENCODED_HOLES[encoded])
        rest = rest[position + len(encoded) :]
    pieces.append(rest)
    if any("\\u0000outbox-" in piece for piece in pieces):
        return None, ()
    return tuple(pieces), tuple(holes)


_SCALARS = (int, float, bool)


def _scalar_repr(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        text: str = value
        # saferepr quotes text with single quotes and escapes only those (not repr()).
        return "'" + text.replace("'", "\\'") + "'"
    if kind in _SCALARS:
        return str(value)
    if value is None:
        return "None"
    return None


def _flat_repr(value: Any) -> str | None:
    """saferepr() of a flat tuple, list or dict of plain scalars; None for anything else."""
    kind = type(value)
    if kind is dict:
        items = [(_scalar_repr(k), _scalar_repr(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if kind is not tuple and kind is not list:
        return None
    parts = [_scalar_repr(v) for v in value]
    if None in parts:
        return None
    inner = ", ".join(parts)  # type: ignore[arg-type]
    if kind is list:
        return f"[{inner}]"
    return f"({inner},)" if len(parts) == 1 else f"({inner})"


def argsrepr(value: Any, maxlen: int, maxlevels: int) -> str:
    """Celery's saferepr(value, maxlen, maxlevels=...), computed quickly for flat values.

    Task arguments are usually a few scalars; saferepr streams them token by token. For a
    flat container of int/float/bool/None/str that fits in `maxlen` its output is plain
    concatenation (tests compare the two on generated values); anything else is saferepr's.
    """
    if maxlevels >= 1:
        text = _flat_repr(value)
        if text is not None and len(text) < maxlen:
            return text
    return saferepr(value, maxlen, maxlevels=maxlevels)


def _fill(
    template: Template, call: Call, settings: writeconf.WriteSettings
) -> tuple[Any, serialization.OutboxRow]:
    args = call.args or ()
    kwargs = call.kwargs or {}
    options = call.options
    task_id = options.get("task_id") or uuid()
    values = {
        "id": encode_basestring_ascii(task_id),
        "argsrepr": encode_basestring_ascii(
            argsrepr(args, template.repr_maxsize, template.repr_maxlevels)
        ),
        "kwargsrepr": encode_basestring_ascii(
            argsrepr(kwargs, template.kwrepr_maxsize, template.repr_maxlevels)
        ),
        "group_index": str(options.get("group_index")),
    }
    parts = [template.pieces[0]]
    for hole, piece in zip(template.holes, template.pieces[1:], strict=True):
        parts.append(values[hole])
        parts.append(piece)
    row = serialization.OutboxRow(
        task_id=task_id,
        task_name=template.name,
        args=serialization.dumps(list(args), "task args"),
        kwargs=serialization.dumps(dict(kwargs), "task kwargs"),
        options="".join(parts),
        context=serialization.dumps_context(context.capture(settings.structlog_keys)),
    )
    serialization.validate_row(row)
    result = template.result_cls(task_id)
    result.ignored = template.ignored
    if template.add_to_parent:
        call.app.current_worker_task.add_trail(result)
    return result, row
