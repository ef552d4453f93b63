"""The template path: later calls of one shape reuse the message Celery built for the first.

The first call of a task with a given set of options (its *shape*) goes through Celery's own
`send_task` (routing, headers, properties, everything). Its stored `options` text becomes a
template whose only holes are what Celery computes per call: `argsrepr`, `kwargsrepr`, the
group index, the `origin` (this process), `reply_to` (this thread) and the values of custom
headers. The task id (also the correlation id, and the root id of a top-level task) is not
in the text: the compact layout (compact.py) leaves it to the row's `task_id` column. Later
calls fill the holes with Celery's own functions (`uuid`, `saferepr`, `anon_nodename`,
`thread_oid`) and return the same `AsyncResult` Celery would.

A shape is used only when nothing else can differ between two calls: no ETA, countdown,
expiry, links, chain, chord or stamps; custom headers whose names are not Celery's own;
routes that map names to queues (no router functions, which see the arguments); no publish
signal receivers and no `task-sent` events (they see or carry each message); Celery's own
`send_task`, message builder and router (or Sentry's known wrapper around `send_task`, which
is applied around the template path exactly as around Celery's). Anything else takes
Celery's full path. tests/integration/test_template_equivalence.py compares both paths byte
for byte over many shapes.

Templates belong to their app and are dropped when its configuration changes (`app.conf`
edited, or Django's `setting_changed`), since Celery reads some settings on every call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii
from typing import Any

import celery
from celery import signals as celery_signals
from celery.app.amqp import AMQP
from celery.app.routes import MapRoute, Router
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from django.core.signals import setting_changed
from kombu import Exchange, Queue

from outbox_notify import compact, conf, serialization
from outbox_notify._write import context, instrumentation
from outbox_notify._write import settings as write_settings
from outbox_notify.limits import MAX_BYTES_PER_CHARACTER

# Celery options that are computed per call; everything else is part of the shape.
_PER_CALL = ("task_id", "group_index", "producer", "publisher", "connection", "headers")
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
        "stamped_headers",
        "argsrepr",
        "kwargsrepr",
        "router",
        "route_name",
    }
)
# The headers Celery writes itself (celery.app.amqp.AMQP.as_task_v2): a custom header of one
# of these names replaces Celery's value, which the template path does not attempt.
CELERY_HEADERS = frozenset(compact.HEADER_ORDER)
_SIGNALS = (
    celery_signals.before_task_publish,
    celery_signals.after_task_publish,
    celery_signals.task_sent,
)
_CACHE_SIZE = 256  # distinct shapes remembered per app
_SCALARS = (str, int, float, bool, type(None))
_KOMBU_ENTITIES = (Queue, Exchange)

# Stand-ins for the holes while the template is encoded. NUL never survives validation in
# a task name or id, so these cannot collide with anything else in the text.
_MARK = "\x00outbox-{}\x00"
_FIXED_HOLES = ("argsrepr", "kwargsrepr", "group_index", "origin", "reply_to")


def _marker(hole: str) -> str:
    return _MARK.format(hole)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Template:
    """The first message of a shape, with holes where later calls differ."""

    name: str
    holes: tuple[str, ...]  # the holes, in the order they appear in the options text
    pieces: tuple[str, ...]  # the options text around the holes: one more than holes
    header_names: tuple[str, ...]  # custom headers, in the order Celery adds them
    extra_holes: bool  # a group index or custom headers to fill
    result_cls: Any  # called with the task id, as Celery's send_task calls result_cls
    ignored: Any
    add_to_parent: bool
    repr_maxsize: int
    kwrepr_maxsize: int
    repr_maxlevels: int


# Call and Made are made for every enqueue: not frozen, as a frozen dataclass sets each field
# through object.__setattr__. Neither is kept beyond the call.
@dataclasses.dataclass(kw_only=True, slots=True)
class Call:
    """One send_task call as an OutboxCelery app received it."""

    app: Any
    name: str
    args: Any
    kwargs: Any
    options: dict[str, Any]


@dataclasses.dataclass(kw_only=True, slots=True)
class Made:
    """What one enqueue produced: Celery's AsyncResult and the validated row."""

    result: Any
    row: serialization.OutboxRow


class _Identity:
    """A key part that matches only the very same object (kombu entities compare loosely)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


class AppTemplates:
    """The templates of one app, and whether its configuration allows them at all.

    `templates` is keyed by the shape (`_shape_key`); `quick` by the options exactly as
    given, for calls that have nothing per call in them (the usual `delay()`), so a repeated
    call finds its template without working out its shape again.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.templates: dict[Any, Template | None] = {}
        self.quick: dict[Any, Template] = {}
        self.conf: Any = None
        self.changes: dict[str, Any] | None = None
        self.eligible = False

    def current(self) -> bool:
        """Whether templates may be used now; forgets them when the configuration changed."""
        conf = self.app.conf
        if conf is self.conf and conf.changes == self.changes:
            return self.eligible
        with self.lock:
            self.templates = {}
            self.quick = {}
            self.eligible = _app_eligible(self.app)
            self.conf = conf
            self.changes = dict(conf.changes)
        return self.eligible

    def forget(self) -> None:
        """Drop every template (Django settings changed; Celery may read them)."""
        self.conf = None

    def put(self, key: Any, template: Template | None, quick: Any) -> None:
        with self.lock:
            if len(self.templates) >= _CACHE_SIZE:
                self.templates = {}
                self.quick = {}
            self.templates[key] = template
            if template is not None and quick is not None:
                self.quick[quick] = template


_MISSING: Any = object()
_every_app: weakref.WeakSet[AppTemplates] = weakref.WeakSet()


def for_app(app: Any) -> AppTemplates:
    """The template cache of `app` (made on first use)."""
    cache: AppTemplates | None = app.__dict__.get("_outbox_templates")
    if cache is None:
        cache = app.__dict__.setdefault("_outbox_templates", AppTemplates(app))
        _every_app.add(cache)
    return cache


def _forget_all(**kwargs: Any) -> None:
    for cache in list(_every_app):
        cache.forget()


setting_changed.connect(_forget_all, dispatch_uid="outbox_notify.templates")


def enqueue(call: Call, settings: write_settings.WriteSettings) -> Made:
    """Build the message of one call: from its shape's template, or Celery's full path.

    Celery's full path is `call.app.record()`: Celery's own (unwrapped) send_task against a
    recording producer.
    """
    cache = for_app(call.app)
    if not cache.current() or not _publish_unobserved():
        return _record(call, call.options, settings)
    parent = call.app.current_worker_task
    options = call.options
    values = options.values()
    quick: Any = (
        call.name,
        parent.request.id if parent is not None else None,
        tuple(options),
        tuple(values),
        tuple(map(type, values)),
    )
    try:
        template = cache.quick.get(quick)
    except TypeError:  # an unhashable option: this call has a shape of its own
        template = quick = None
    if template is not None and _plain_arguments(call):
        return _fill(template, call, parent, settings)
    return _by_shape(cache, call, parent, quick=quick, settings=settings)


def _by_shape(
    cache: AppTemplates,
    call: Call,
    parent: Any,
    *,
    quick: Any,
    settings: write_settings.WriteSettings,
) -> Made:
    key = _shape_key(call, parent)
    if key is None:
        return _record(call, call.options, settings)
    template = cache.templates.get(key, _MISSING)
    if template is _MISSING:
        made = _record(call, dict(call.options), settings)
        quick = quick if _quickable(call.options) else None
        cache.put(key, _template(call, made, parent), quick)
        return made
    if template is None:
        return _record(call, call.options, settings)
    if quick is not None and _quickable(call.options):
        cache.put(key, template, quick)
    return _fill(template, call, parent, settings)


def _record(call: Call, options: dict[str, Any], settings: write_settings.WriteSettings) -> Made:
    made: Made = call.app.record(call.name, call.args, call.kwargs, options, settings)
    return made


def _publish_unobserved() -> bool:
    """Whether nothing sees each message as Celery sends it (signals, unknown wrappers)."""
    before, after, sent = _SIGNALS
    if before.receivers or after.receivers or sent.receivers:
        return False
    return instrumentation.known_send_task()


def _plain_arguments(call: Call) -> bool:
    # Anything else makes Celery raise its own TypeError on the full path.
    args, kwargs = call.args, call.kwargs
    return (type(args) is tuple or isinstance(args, list | tuple | None)) and (
        type(kwargs) is dict or isinstance(kwargs, Mapping | None)
    )


def _quickable(options: Mapping[str, Any]) -> bool:
    """Whether the options as given can key a template (nothing per call, no kombu entity)."""
    if any(options.get(name) is not None for name in _PER_CALL):
        return False
    return not any(isinstance(value, _KOMBU_ENTITIES) for value in options.values())


def _shape_key(call: Call, parent: Any) -> Any:
    """What must be equal for two calls to share a template; None when it cannot be shared."""
    if not _eligible(call):
        return None
    options = call.options
    shape = dict(options)
    for name in _PER_CALL:
        shape.pop(name, None)
    values = _key_values(shape.values())
    if values is None:
        return None
    key = (
        call.name,
        parent.request.id if parent is not None else None,
        tuple(shape),
        values,
        tuple(options.get("headers") or ()),
        # A group index is a hole, or absent from the text: a shape has one or the other.
        options.get("group_index") is None,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _eligible(call: Call) -> bool:
    """Whether nothing but the holes can differ between two calls of this call's shape."""
    options = call.options
    if not _plain_arguments(call):
        return False
    if any(options[name] is not None for name in _FULL_PATH.intersection(options)):
        return False
    headers = options.get("headers") or {}
    return isinstance(headers, dict) and all(
        type(k) is str and k not in CELERY_HEADERS for k in headers
    )


def _key_values(values: Any) -> tuple[Any, ...] | None:
    parts: list[Any] = []
    for value in values:
        kind = type(value)
        if kind in _SCALARS:
            parts.append((kind, value))  # 1, 1.0 and True are equal keys, not equal JSON
        elif isinstance(value, _KOMBU_ENTITIES):
            parts.append(_Identity(value))  # kombu entities compare equal too loosely
        elif isinstance(value, dict | list | set | tuple | frozenset):
            return None  # containers hide 1/True/1.0 from the key; often built per call
        else:
            parts.append((kind, value))
    return tuple(parts)


def _app_eligible(app: Any) -> bool:
    """Whether the app's configuration lets two calls of one shape differ only in the holes."""
    conf = app.conf
    if conf.task_send_sent_event or conf.task_protocol != 2 or conf.task_always_eager:
        return False
    amqp = app.amqp
    if type(amqp).as_task_v2 is not AMQP.as_task_v2:
        return False
    if type(amqp)._create_task_sender is not getattr(AMQP, "_create_task_sender", None):
        return False
    if type(amqp.router) is not Router or not app.plain_super_send_task():
        return False
    routes: Any = getattr(amqp.router, "routes", None)
    return routes is not None and all(isinstance(route, MapRoute) for route in routes)


def _template(call: Call, made: Made, parent: Any) -> Template | None:
    """The shape's template, or None when its first message cannot be split into holes.

    Only a row in the compact layout (compact.py) becomes a template: its per-call values
    are always there, at the top level (and the task id, which is also the correlation id
    and a top-level task's root id, is not in the text at all). The template is checked
    against the message it came from: filled with that call's own values it must give back
    the recorded text byte for byte, and the task id may appear nowhere in it.
    """
    if made.row.schema_version != serialization.COMPACT_VERSION:
        return None
    text, task_id = made.row.options, made.row.task_id
    options = json.loads(text)
    headers = options.get("headers") or {}
    header_names = tuple(call.options.get("headers") or ())
    first = {
        "argsrepr": options["argsrepr"],
        "kwargsrepr": options["kwargsrepr"],
        "origin": options["origin"],
        "reply_to": options["reply_to"],
        "group_index": headers.get("group_index"),
        **{f"header_{i}": headers.get(name) for i, name in enumerate(header_names)},
    }
    options.update(argsrepr=_marker("argsrepr"), kwargsrepr=_marker("kwargsrepr"))
    if not call.options.get("origin"):
        options["origin"] = _marker("origin")  # else a given origin, the same for the shape
    if not call.options.get("reply_to"):
        options["reply_to"] = _marker("reply_to")  # else a given reply_to (group members)
    if call.options.get("group_index") is not None:
        headers["group_index"] = _marker("group_index")
    for index, name in enumerate(header_names):
        headers[name] = _marker(f"header_{index}")
    marked = serialization.dumps(options, "task options")
    pieces, holes = _split(marked, len(header_names))
    if pieces is None or task_id in marked:
        return None
    amqp = call.app.amqp
    template = Template(
        name=call.name,
        holes=holes,
        pieces=pieces,
        header_names=header_names,
        extra_holes=bool(header_names) or "group_index" in holes,
        result_cls=_result_factory(call.options.get("result_cls") or call.app.AsyncResult),
        ignored=call.options.get("ignore_result"),
        add_to_parent=bool(call.options.get("add_to_parent", True)) and parent is not None,
        repr_maxsize=amqp.argsrepr_maxsize,
        kwrepr_maxsize=amqp.kwargsrepr_maxsize,
        repr_maxlevels=_repr_maxlevels(call.app),
    )
    encoded = {hole: serialization.dumps(value, "task options") for hole, value in first.items()}
    return template if _text(template, encoded) == text else None


def _result_factory(result_cls: Any) -> Any:
    """What makes a call's AsyncResult: `result_cls` itself, or the same call made directly.

    `delay()` passes the task's own `AsyncResult` method; unless a task class overrides it,
    that method builds the app's result class with the task's backend and name, which is done
    here without the two lookups of the app in between.
    """
    task = getattr(result_cls, "__self__", None)
    if task is None or getattr(result_cls, "__func__", None) is not _TASK_ASYNC_RESULT:
        return result_cls
    klass, name = task._get_app().AsyncResult, task.name

    def make(task_id: str) -> Any:
        return klass(task_id, backend=task.backend, task_name=name)

    return make


_TASK_ASYNC_RESULT = celery.Task.AsyncResult


# saferepr's own default: what Celery releases before the task_repr_maxlevels setting use.
_SAFEREPR_MAXLEVELS = 3


def _repr_maxlevels(app: Any) -> int:
    """The nesting depth Celery's argsrepr uses: the setting (Celery 5.4+) or saferepr's default."""
    return int(app.conf.get("task_repr_maxlevels", _SAFEREPR_MAXLEVELS))


def _text(template: Template, values: Mapping[str, str]) -> str:
    """The options text of one call: the template's pieces with the holes' values between."""
    pieces = template.pieces
    parts = [pieces[0]]
    for hole, piece in zip(template.holes, pieces[1:], strict=True):
        parts += (values[hole], piece)
    return "".join(parts)


def _split(text: str, header_count: int) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    encoded = {
        encode_basestring_ascii(_marker(h)): h
        for h in (*_FIXED_HOLES, *(f"header_{i}" for i in range(header_count)))
    }
    pieces: list[str] = []
    holes: list[str] = []
    rest = text
    while True:
        found = [(rest.find(enc), enc) for enc in encoded if enc in rest]
        if not found:
            break
        position, marker = min(found)
        pieces.append(rest[:position])
        holes.append(encoded[marker])
        rest = rest[position + len(marker) :]
    pieces.append(rest)
    if any("\\u0000outbox-" in piece for piece in pieces):
        return None, ()
    return tuple(pieces), tuple(holes)


def _scalar_repr(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        text: str = value
        # saferepr quotes text with single quotes and escapes only those (not repr()).
        return "'" + text.replace("'", "\\'") + "'"
    if kind is int or kind is float or kind is bool:
        return str(value)
    if value is None:
        return "None"
    return None


_EMPTY_REPRS: dict[type, str] = {tuple: "()", list: "[]", dict: "{}"}


def _flat_repr(value: Any) -> str | None:
    """saferepr() of a flat tuple, list or dict of plain scalars; None for anything else."""
    kind = type(value)
    if kind is dict:
        items: list[str] = []
        for key, item in value.items():
            key_text, item_text = _scalar_repr(key), _scalar_repr(item)
            if key_text is None or item_text is None:
                return None
            items.append(f"{key_text}: {item_text}")
        return "{" + ", ".join(items) + "}"
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
        # No positional (or keyword) arguments, as delay() often has: a constant.
        text = _EMPTY_REPRS.get(type(value)) if not value else _flat_repr(value)
        if text is not None and len(text) < maxlen:
            return text
    return saferepr(value, maxlen, maxlevels=maxlevels)


def origin() -> str:
    """Celery's `origin` header for this process, JSON-encoded.

    anon_nodename() is made of the pid and the host name, which Celery reads once per
    process (celery.utils.nodenames memoizes gethostname): one text per process, forgotten
    in a forked child (which has a pid of its own).
    """
    if not _origin:
        _origin.append(encode_basestring_ascii(anon_nodename()))
    return _origin[0]


_origin: list[str] = []
os.register_at_fork(after_in_child=_origin.clear)


def _hole_values(template: Template, call: Call) -> dict[str, str]:
    args = call.args or ()
    kwargs = call.kwargs or {}
    values = {
        "argsrepr": encode_basestring_ascii(
            argsrepr(args, template.repr_maxsize, template.repr_maxlevels)
        ),
        "kwargsrepr": encode_basestring_ascii(
            argsrepr(kwargs, template.kwrepr_maxsize, template.repr_maxlevels)
        ),
        "origin": origin(),
        "reply_to": encode_basestring_ascii(call.app.thread_oid),
    }
    if template.extra_holes:
        options = call.options
        group_index = options.get("group_index")
        values["group_index"] = (
            str(group_index)
            if type(group_index) is int
            else serialization.dumps(group_index, "task options")
        )
        headers = options.get("headers") or {}
        for index, name in enumerate(template.header_names):
            values[f"header_{index}"] = serialization.dumps(headers[name], "task options")
    return values


def _maybe_too_big(row: serialization.OutboxRow) -> bool:
    """Whether the row may be over the size limit (see limits.message_size's quick bound).

    The rest of what validate_row checks holds for every filled row: the task name passed it
    with the shape's first call, a generated id is hex and dashes, and nothing is held.
    """
    limit = conf.max_message_bytes()
    if limit is None:
        return False
    return (len(row.args) + len(row.kwargs) + len(row.options)) * MAX_BYTES_PER_CHARACTER > limit


# The nibble after a UUID4's third dash holds its variant (binary 10xx): 8, 9, a or b.
_VARIANT = dict(zip("0123456789abcdef", "89ab89ab89ab89ab", strict=True))


def new_task_id() -> str:
    """What Celery's `uuid()` gives a task without an id: a random UUID4 as text.

    Formatted from 16 random bytes with the version and variant set, as `uuid.uuid4()` sets
    them, without building the `uuid.UUID` object (most of the cost of `str(uuid4())`).
    """
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


def _fill(
    template: Template, call: Call, parent: Any, settings: write_settings.WriteSettings
) -> Made:
    given = call.options.get("task_id")
    task_id = given or new_task_id()
    args = call.args or ()
    kwargs = call.kwargs or {}
    row = serialization.OutboxRow(
        task_id=task_id,
        task_name=template.name,
        args=serialization.dumps_args(args),
        kwargs=serialization.dumps_kwargs(kwargs),
        options=_text(template, _hole_values(template, call)),
        context=serialization.dumps_context(
            context.capture(
                settings.structlog_keys,
                sentry=not context.carries_sentry_trace(call.options.get("headers")),
            )
        ),
        schema_version=serialization.COMPACT_VERSION,
    )
    if (given and "\x00" in given) or _maybe_too_big(row):
        serialization.validate_row(row)  # raises the error single calls raise
    result = template.result_cls(task_id)
    result.ignored = template.ignored
    if template.add_to_parent:
        parent.add_trail(result)
    return Made(result=result, row=row)
