"""Events that cannot be published fail at the call, inside the caller's transaction, writing nothing."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import structlog
from django.db import transaction
from django.test import override_settings
from kombu import Exchange

from outbox_notify import events
from outbox_notify.events import EventError
from outbox_notify.exceptions import ConfigurationError, SerializationError
from outbox_notify.models import OutboxMessage
from outbox_notify.serialization import EVENT_VERSION

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the point is that the caller's real transaction stays usable.


@dataclasses.dataclass
class Shipped:
    """A dataclass event."""

    order: int
    payload: Any = None


@dataclasses.dataclass
class BadlyTyped:
    """A dataclass whose declared type is not a str."""

    event_type: ClassVar[Any] = 42


class NotJson:
    """An object JSON has no representation for."""


BAD: dict[str, tuple[Callable[[], Any], str]] = {
    "plain object": (lambda: events.publish(object(), exchange="x"), "dataclass instance"),
    "dataclass class": (lambda: events.publish(Shipped, exchange="x"), "dataclass instance"),
    "mapping without type": (lambda: events.publish({"data": 1}, exchange="x"), "'type'"),
    "empty type": (lambda: events.publish({"type": ""}, exchange="x"), "type must be"),
    "unknown key": (
        lambda: events.publish({"type": "t", "sujbect": "s"}, exchange="x"),
        "sujbect",
    ),
    "naive time": (
        lambda: events.publish({"type": "t", "time": dt.datetime(2026, 1, 1)}, exchange="x"),
        "timezone-aware",
    ),
    "time as text": (
        lambda: events.publish({"type": "t", "time": "2026-01-01T00:00:00Z"}, exchange="x"),
        "timezone-aware",
    ),
    "id not str": (lambda: events.publish({"type": "t", "id": 5}, exchange="x"), "id must"),
    "NUL in type": (lambda: events.publish({"type": "a\x00b"}, exchange="x"), "NUL"),
    "non-JSON data": (lambda: events.publish(Shipped(1, NotJson()), exchange="x"), "JSON"),
    "NaN in data": (lambda: events.publish(Shipped(1, float("nan")), exchange="x"), "JSON"),
    "type not str": (lambda: events.publish(BadlyTyped(), exchange="x"), "event_type"),
    "empty exchange": (lambda: events.publish(Shipped(1), exchange=""), "exchange name"),
    "nameless Exchange": (
        lambda: events.publish(Shipped(1), exchange=Exchange("")),
        "exchange name",
    ),
    "exchange not str": (lambda: events.publish(Shipped(1), exchange=5), "exchange must"),
    "routing key too long": (
        lambda: events.publish(Shipped(1), exchange="x", routing_key="k" * 256),
        "255 bytes",
    ),
    "binding header": (
        lambda: events.publish(Shipped(1), exchange="x", headers={"cloudEvents_id": "1"}),
        "cloudEvents_",
    ),
    "header not JSON": (
        lambda: events.publish(Shipped(1), exchange="x", headers={"x": NotJson()}),
        "headers",
    ),
    "headers not mapping": (
        lambda: events.publish(Shipped(1), exchange="x", headers=[("a", 1)]),
        "mapping",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_event_raises_at_the_call_and_the_transaction_goes_on(case: str) -> None:
    """Each bad event raises EventError (a SerializationError and a ValueError, as documented)
    naming the problem; nothing is written and the caller's transaction can still commit."""
    call, says = BAD[case]
    with transaction.atomic():
        with pytest.raises(EventError, match=says):
            call()
        events.publish(Shipped(2), exchange="orders")  # the transaction is still usable
    assert list(OutboxMessage.objects.values_list("schema_version", flat=True)) == [EVENT_VERSION]


def test_event_error_is_what_the_docs_promise() -> None:
    """EventError is a SerializationError (so a TypeError) and a ValueError."""
    assert issubclass(EventError, SerializationError)
    assert issubclass(EventError, TypeError)
    assert issubclass(EventError, ValueError)


@override_settings(OUTBOX_NOTIFY_MAX_MESSAGE_BYTES=1000)
def test_event_over_the_size_limit_fails_at_the_call() -> None:
    """The message size limit of tasks applies to events, and the error names the event."""
    with pytest.raises(EventError, match=r"event 'big' is .* over the limit"):
        events.publish({"type": "big", "data": "x" * 2000}, exchange="x")
    assert not OutboxMessage.objects.exists()


@override_settings(OUTBOX_NOTIFY_EVENT_SOURCE=None)
def test_publish_without_a_source_names_the_setting() -> None:
    """Without OUTBOX_NOTIFY_EVENT_SOURCE publish refuses with a ConfigurationError saying so."""
    with pytest.raises(ConfigurationError, match="OUTBOX_NOTIFY_EVENT_SOURCE is not set"):
        events.publish(Shipped(1), exchange="x")
    assert not OutboxMessage.objects.exists()


@override_settings(OUTBOX_NOTIFY_EVENT_SOURCE="not a uri")
def test_source_with_spaces_is_refused() -> None:
    """A source that cannot be a URI-reference is refused with the setting's name."""
    with pytest.raises(ConfigurationError, match="OUTBOX_NOTIFY_EVENT_SOURCE must be"):
        events.publish(Shipped(1), exchange="x")


def test_rolled_back_event_leaves_no_row() -> None:
    """publish() writes in the caller's transaction: its rollback removes the event."""
    with pytest.raises(RuntimeError), transaction.atomic():
        events.publish(Shipped(1), exchange="orders")
        raise RuntimeError
    assert not OutboxMessage.objects.exists()


def test_publish_outside_a_transaction_writes_now_and_warns() -> None:
    """Outside atomic() the event is written in autocommit and a warning is logged, as for tasks."""
    with structlog.testing.capture_logs() as logs:
        sent = events.publish(Shipped(1), exchange="orders")
    assert OutboxMessage.objects.get().task_id == sent.id
    warning = next(e for e in logs if e["event"] == "outbox.enqueue_outside_transaction")
    assert warning["task_name"] == sent.type
