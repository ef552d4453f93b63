"""Queue declarations a row names instead of carrying: those the Celery configuration gives.

Celery declares the queue of every task it sends (`declare=[queue]`), and that declaration
was most of a stored message. When the declared queue is exactly the one the app's
configuration gives for its name (`task_queues`, `task_default_queue`, `task_default_exchange*`,
and the settings with which Celery creates a missing queue), a row stores only the name and a
digest of the declaration; the relay builds the declaration from its own app
(OUTBOX_NOTIFY_CELERY_APP: the same app, the same configuration) and checks the digest.

The writer compares with a `Queues` mapping built afresh from the configuration, never with
the app's live one: a queue added at run time (`app.amqp.queues.select_add(...)`, a `Queue`
object passed to `apply_async`) exists only in the writer's process, so its row carries it
whole. If the relay's configuration gives the queue otherwise (a configuration deployed to
the writers before the relays), the digests differ and the relay publishes without declaring
the queue rather than declare it wrongly (`outbox.queue_declaration_differs`, once per queue).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from typing import Any

import structlog
from kombu import Queue

from outbox_notify.exceptions import ConfigurationError
from outbox_notify.serialization import queue_to_json

log = structlog.get_logger("outbox_notify")

DIGEST_CHARS = 8  # hex characters of sha256 kept: enough to tell two configurations apart
_CACHE_SIZE = 256  # queues (or queue objects) remembered per app, and by the relay
_SELF = '"\\u0000"'  # stands for the queue's own name in the text a digest is taken of


def declaration_text(declaration: dict[str, Any]) -> str:
    """A queue's declaration (kombu's as_dict) as canonical JSON text."""
    return json.dumps(declaration, sort_keys=True, default=str)


def digest(name: str, declaration: dict[str, Any]) -> str:
    """The digest a row stores with a queue's name: its declaration, its own name abstracted.

    Abstracting the name (wherever a value equals it: the queue, its exchange, its routing
    key) makes the digest describe how the configuration declares such a queue, which is
    what the writer and the relay must agree on.
    """
    text = declaration_text(declaration).replace(json.dumps(name), _SELF)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def configured(app: Any, name: str) -> Queue | None:
    """The queue `name` as the app's configuration alone gives it (None: it gives none).

    A `Queues` mapping built afresh, as Celery builds `app.amqp.queues`: the configured
    queues, the default queue, or a queue Celery would create for a missing name.
    """
    try:
        queue: Queue = app.amqp.Queues(app.conf.task_queues)[name]
    except (KeyError, ValueError):  # no such queue and none created, or a bad queue type
        return None
    return queue


class _AppQueues:
    """What one app's configuration says of the queue objects its writer declares."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.conf: Any = None
        self.changes: dict[str, Any] | None = None
        self.named: dict[int, tuple[Queue, tuple[str, str] | None]] = {}

    def current(self) -> None:
        """Forget every answer when the app's configuration changed since they were given."""
        conf = self.app.conf
        if conf is not self.conf or conf.changes != self.changes:
            with self.lock:
                self.named = {}
                self.conf = conf
                self.changes = dict(conf.changes)

    def forget(self) -> None:
        self.conf = None

    def name_of(self, queue: Queue) -> tuple[str, str] | None:
        """(name, digest) when `queue` is the configured queue of its name, else None."""
        self.current()
        found = self.named.get(id(queue))
        # The object is kept with the answer, so an id reused by a new object cannot match.
        if found is not None and found[0] is queue:
            return found[1]
        answer = self._compare(queue)
        with self.lock:
            if len(self.named) >= _CACHE_SIZE:
                self.named = {}
            self.named[id(queue)] = (queue, answer)
        return answer

    def _compare(self, queue: Queue) -> tuple[str, str] | None:
        name = queue.name
        if not isinstance(name, str) or not name:
            return None
        given = configured(self.app, name)
        if given is None:
            return None
        ours = queue_to_json(queue)
        if declaration_text(ours) != declaration_text(queue_to_json(given)):
            return None
        return name, digest(name, ours)


def _for_app(app: Any) -> _AppQueues:
    found: _AppQueues | None = app.__dict__.get("_outbox_queues")
    if found is None:
        if not _apps:
            # Imported here: the relay's side of this module stays free of Django.
            from django.core.signals import setting_changed

            setting_changed.connect(_forget_all, dispatch_uid="outbox_notify.queues")
        found = app.__dict__.setdefault("_outbox_queues", _AppQueues(app))
        _apps.add(found)
    return found


_apps: weakref.WeakSet[_AppQueues] = weakref.WeakSet()


def _forget_all(**kwargs: Any) -> None:
    """Django settings changed (Celery may read its configuration from them)."""
    for found in list(_apps):
        found.forget()


def named(app: Any, declare: Any) -> tuple[str, str] | None:
    """The writer's side: (name, digest) when `declare` is one queue the app's configuration
    gives exactly so; None when the row must carry the declaration whole."""
    if app is None or type(declare) not in (list, tuple) or len(declare) != 1:
        return None
    queue = declare[0]
    if type(queue) is not Queue:  # a Broadcast or other subclass declares differently
        return None
    return _for_app(app).name_of(queue)


# --- the relay's side ------------------------------------------------------------------

_declarations: dict[tuple[str, str], dict[str, Any] | None] = {}
_relay_app: list[Any] = []


def use_app(app: Any | None) -> None:
    """Build the relay's declarations with this app (runner.py passes the relay's own); None
    goes back to the default, OUTBOX_NOTIFY_CELERY_APP."""
    _relay_app[:] = [] if app is None else [app]
    _declarations.clear()


def _app() -> Any:
    if _relay_app:
        return _relay_app[0]
    from outbox_notify import conf

    try:
        return conf.celery_app()
    except ConfigurationError:
        return None  # the fake relay of a user's tests, without the setting: nothing declares


def declaration(name: str, stored_digest: str) -> dict[str, Any] | None:
    """The relay's side: the declaration of queue `name` a row names, as the relay's app
    configures it; None when that is not the declaration the writer saw (then nothing is
    declared)."""
    key = (name, stored_digest)
    if key in _declarations:
        return _declarations[key]
    found = _derive(name, stored_digest)
    if len(_declarations) >= _CACHE_SIZE:
        _declarations.clear()
    _declarations[key] = found
    return found


def _derive(name: str, stored_digest: str) -> dict[str, Any] | None:
    app = _app()
    if app is None:
        return None
    queue = configured(app, name)
    ours = queue_to_json(queue) if queue is not None else None
    if ours is not None and digest(name, ours) == stored_digest:
        return ours
    log.warning(
        "outbox.queue_declaration_differs",
        queue=name,
        stored_digest=stored_digest,
        relay_digest=None if ours is None else digest(name, ours),
    )
    return None
