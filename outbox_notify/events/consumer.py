"""Consume domain events once: `Consumer`, its handlers, and one event's inbox transaction.

A `Consumer` names a queue bound to an exchange with routing patterns and maps event types to
handlers. Each event runs its handler inside `transaction.atomic()` on the outbox database
together with an inbox record (`outbox_notify_inbox_v1`, the table of OnceTask) of the event's
source and id (`inbox_key`) in the consumer's own scope, so the handler's database effects
commit once per event and consumer, however often the broker delivers the event.

This module decides what one message body becomes (handled, skipped, undecodable, failed);
`outbox_notify.events.delivery` talks to the broker: acknowledgements, retries with backoff,
dead letters, reconnection. `manage.py outbox_consume` runs a consumer. See
docs/events.md, "Consuming once".
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import structlog
from django.db import connections, transaction

from outbox_notify import conf, inbox, observability, signals
from outbox_notify.events import envelope as wire
from outbox_notify.exceptions import ConfigurationError, OnceKeyError

log = structlog.get_logger("outbox_notify")

H = TypeVar("H", bound=Callable[..., Any])
SCOPE_PREFIX = "events:"  # inbox scope of a consumer: this prefix and the consumer's name
MAX_ATTEMPTS = 5  # handler runs before an event is dead-lettered
BACKOFF = 1.0  # seconds before the first retry; doubles with each retry
MAX_BACKOFF = 60.0  # seconds, the longest wait between two runs
PREFETCH = 16  # messages the broker hands over unacknowledged (retries waiting included)

__all__ = ["Consumer", "Outcome", "Result", "event_type_of", "inbox_key"]


def event_type_of(cls: type) -> str:
    """An event class's type: its `event_type` attribute, else `module.QualName` (the publisher's rule)."""
    declared = getattr(cls, "event_type", None)
    if isinstance(declared, str) and declared:
        return declared
    return f"{cls.__module__}.{cls.__qualname__}"


class Outcome(enum.Enum):
    """What became of one message."""

    HANDLED = "handled"  # the handler's transaction committed with the event's key
    SKIPPED = "skipped"  # the event's key was committed already in this consumer's scope
    UNDECODABLE = "undecodable"  # dead-letter at once: the reason says why
    FAILED = "failed"  # the handler (or its transaction) raised; retry or dead-letter


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """One message's outcome, with what the logs, retries and dead letters need."""

    outcome: Outcome
    event_id: str | None = None
    event_type: str | None = None
    reason: str | None = None  # why undecodable, or the handler's error in one line
    error: BaseException | None = None  # what the failed attempt raised


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    """A handler and how to call it."""

    event_type: str
    function: Callable[..., Any]
    cls: type | None  # the dataclass the data is decoded into; None: the handler gets the Envelope
    with_envelope: bool


class Consumer:
    """A queue bound to an exchange, with one handler per event type, each run once per event.

    `name` is the consumer's identity: its inbox scope (`events:<name>`), and its queue's name
    unless `queue` is given. Two consumers with different names each handle an event once.
    Everything about the broker is read when the consumer runs, never at import.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        name: str,
        *,
        exchange: str,
        routing_keys: Sequence[str] = ("#",),
        exchange_type: str = "topic",
        queue: str | None = None,
        dead_letter_exchange: str | None = None,
        broker_url: str | None = None,
        transport_options: Mapping[str, Any] | None = None,
        max_attempts: int = MAX_ATTEMPTS,
        backoff: float = BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        prefetch: int = PREFETCH,
    ) -> None:
        try:
            self.name = inbox.checked_key(name, "the consumer's name")
            self.scope = inbox.checked_key(SCOPE_PREFIX + self.name, "the consumer's inbox scope")
        except OnceKeyError as exc:
            raise ConfigurationError(str(exc)) from exc
        self.exchange = exchange
        self.routing_keys = tuple(routing_keys)
        self.exchange_type = exchange_type
        self.queue = queue or self.name
        self.dead_letter_exchange = dead_letter_exchange or f"{self.queue}.dead-letter"
        self.broker_url = broker_url
        self.transport_options = dict(transport_options or {})
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.prefetch = prefetch
        self._handlers: dict[str, Registration] = {}
        self._fallback: Registration | None = None
        _check_settings(self)

    def __repr__(self) -> str:
        return f"<Consumer {self.name!r} queue={self.queue!r} exchange={self.exchange!r}>"

    @property
    def event_types(self) -> list[str]:
        """The event types with a handler of their own."""
        return sorted(self._handlers)

    def handler(self, event: type | str, *, with_envelope: bool = False) -> Callable[[H], H]:
        """Register the decorated function for an event class (decoded into it) or a type string.

        The function gets the dataclass instance (for a class) or the `Envelope` (for a type
        string); with `with_envelope=True` the `Envelope` comes as a second argument too.
        """
        registration = _registration(event, with_envelope)
        if registration.event_type in self._handlers:
            raise ConfigurationError(
                f"consumer {self.name!r} has a handler for {registration.event_type!r} already"
            )

        def register(function: H) -> H:
            self._handlers[registration.event_type] = dataclasses.replace(
                registration, function=function
            )
            return function

        return register

    def fallback(self, function: H) -> H:
        """Register the handler of every type without one; it gets the `Envelope`."""
        self._fallback = Registration(
            event_type="*", function=function, cls=None, with_envelope=False
        )
        return function

    def process(self, body: bytes | str) -> Result:
        """Decode one body and run its handler once per event; never raises for bad input."""
        try:
            event, registration = self._decode(body)
        except wire.UndecodableEvent as exc:
            known = wire.identify(body)
            return Result(
                outcome=Outcome.UNDECODABLE,
                event_id=known.id,
                event_type=known.type,
                reason=str(exc),
            )
        return self._run(event, registration)

    def _decode(self, body: bytes | str) -> tuple[wire.Envelope, Registration]:
        event = wire.decode(body)
        try:
            inbox.checked_key(event.id, "the event id")
        except OnceKeyError as exc:
            raise wire.UndecodableEvent(str(exc)) from exc
        registration = self._handlers.get(event.type, self._fallback)
        if registration is None:
            raise wire.UndecodableEvent(
                f"consumer {self.name!r} has no handler for event type {event.type!r}"
            )
        return event, registration

    def _run(self, event: wire.Envelope, registration: Registration) -> Result:
        """The handler and the inbox record in one transaction; skipped if the key is committed."""
        try:
            argument = _argument(event, registration)
        except wire.UndecodableEvent as exc:
            return _result(Outcome.UNDECODABLE, event, reason=str(exc))
        alias = conf.database_alias()
        key = inbox.OnceKey(scope=self.scope, key=inbox_key(event), derived=False, former=event.id)
        try:
            with transaction.atomic(using=alias):
                if inbox.record(connections[alias], key, task_id=event.id, task_name=event.type):
                    _call(registration, argument, event)
                    inbox.require_commit(connections[alias], "the handler")
                    return _result(Outcome.HANDLED, event)
        except inbox.KeyConflict as exc:
            if inbox.owner(connections[alias], key) is None:
                return _failed(event, exc.__cause__ or exc)
        except Exception as exc:
            return _failed(event, exc)
        self._skipped(event)
        return _result(Outcome.SKIPPED, event)

    def _skipped(self, event: wire.Envelope) -> None:
        log.info(
            "outbox.event_duplicate_skipped",
            consumer=self.name,
            event_id=event.id,
            event_source=event.source,
            event_type=event.type,
            scope=self.scope,
        )
        observability.send_signal(
            signals.outbox_event_duplicate_skipped,
            event_id=event.id,
            event_source=event.source,
            event_type=event.type,
            consumer=self.name,
            scope=self.scope,
        )


def inbox_key(event: wire.Envelope) -> str:
    """The inbox key of an event: its source and its id, which CloudEvents makes unique together.

    `["<source>","<id>"]` as ASCII JSON without spaces: readable in the admin, and two
    different pairs never give the same text. A pair longer than an inbox key may be is keyed
    by `sha256:` and the hex digest of that text. Committed keys are compared with what this
    returns for later deliveries: the format must never change. Releases before it keyed an
    event by its id alone (its `former` key, still honoured when found; docs/events.md).
    """
    pair = json.dumps([event.source, event.id], separators=(",", ":"))
    if len(pair) <= inbox.MAX_KEY_LENGTH:
        return pair
    return "sha256:" + hashlib.sha256(pair.encode("ascii")).hexdigest()


def _check_settings(consumer: Consumer) -> None:
    """A ConfigurationError at construction for values the consumer cannot run with."""
    if not consumer.exchange or not consumer.routing_keys:
        raise ConfigurationError("a Consumer needs an exchange and at least one routing key")
    if consumer.max_attempts < 1 or consumer.prefetch < 1:
        raise ConfigurationError("max_attempts and prefetch must be at least 1")
    if not 0 < consumer.backoff <= consumer.max_backoff:
        raise ConfigurationError("backoff must be above 0 and at most max_backoff")


def _registration(event: type | str, with_envelope: bool) -> Registration:
    if isinstance(event, str):
        if not event:
            raise ConfigurationError("an event type must be a non-empty string")
        return Registration(
            event_type=event, function=_unset, cls=None, with_envelope=with_envelope
        )
    if not (isinstance(event, type) and dataclasses.is_dataclass(event)):
        raise ConfigurationError(f"handler() takes a dataclass or a type string, not {event!r}")
    return Registration(
        event_type=event_type_of(event), function=_unset, cls=event, with_envelope=with_envelope
    )


def _unset(*args: Any) -> None:
    """Placeholder until the decorator receives the function."""


def _argument(event: wire.Envelope, registration: Registration) -> Any:
    """What the handler gets: the data decoded into its dataclass, or the Envelope."""
    cls = registration.cls
    if cls is None:
        return event
    if not isinstance(event.data, dict):
        raise wire.UndecodableEvent(
            f"data of {event.type!r} is a JSON {type(event.data).__name__}, not an object "
            f"for {cls.__qualname__}"
        )
    # Only the fields the class takes at construction: asdict() also gives init=False fields,
    # and a publisher's newer class may carry fields this consumer's class does not know yet.
    accepted = {f.name for f in dataclasses.fields(cls) if f.init}
    data = {name: value for name, value in event.data.items() if name in accepted}
    try:
        return cls(**data)
    except Exception as exc:  # a missing field, or the class's own validation
        raise wire.UndecodableEvent(
            f"data of {event.type!r} does not fit {cls.__qualname__}: {type(exc).__name__}: {exc}"
        ) from exc


def _call(registration: Registration, argument: Any, event: wire.Envelope) -> None:
    if registration.with_envelope:
        registration.function(argument, event)
    else:
        registration.function(argument)


def _result(outcome: Outcome, event: wire.Envelope, **more: Any) -> Result:
    return Result(outcome=outcome, event_id=event.id, event_type=event.type, **more)


def _failed(event: wire.Envelope, exc: BaseException) -> Result:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    return _result(Outcome.FAILED, event, reason=reason, error=exc)


def load(path: str) -> Consumer:
    """The Consumer at a dotted path (`module.attribute`); ConfigurationError if there is none."""
    from django.utils.module_loading import import_string

    try:
        found = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import consumer {path!r}: {exc}") from exc
    if not isinstance(found, Consumer):
        raise ConfigurationError(
            f"{path!r} is a {type(found).__name__}, not an outbox_notify.events.Consumer"
        )
    return found
