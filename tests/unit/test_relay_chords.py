"""The relay's chord wrapper: backend calls first, outages hold rows back unspent."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import redis

from outbox_notify import _chord_calls as chord_calls
from outbox_notify.relay.chords import ChordPublisher
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.serialization import PublishSpec


class Backend:
    """Records chord calls; raises `error` instead while it is set."""

    def __init__(self) -> None:
        self.sizes: list[tuple[str, int]] = []
        self.error: Exception | None = None

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        if self.error is not None:
            raise self.error
        self.sizes.append((group_id, chord_size))


@dataclasses.dataclass
class App:
    """What ChordPublisher uses of a Celery app."""

    backend: Backend


class Inner:
    """A publisher that publishes everything it is given."""

    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        self.sent.extend(messages)
        return [Attempt(Result.PUBLISHED) for _ in messages]

    def check(self) -> None: ...
    def close(self) -> None: ...


def message(row_id: int, calls: list[dict[str, Any]] | None) -> OutgoingMessage:
    """A prepared message with the given backend calls."""
    row = ClaimedRow(
        row_id, f"t{row_id}", "n", "[]", "{}", "{}", "{}", 0, 2, dt.datetime.now(dt.UTC)
    )
    spec = PublishSpec(
        headers={},
        properties={},
        embed={},
        exchange="",
        routing_key="q",
        serializer="json",
        compression=None,
        delivery_mode=2,
        declare_json=[],
        backend_calls=calls,
    )
    return OutgoingMessage(
        row=row, body="[]", spec=spec, headers={}, expiration=None, log_context={}, plain=True
    )


SIZE = {"call": chord_calls.SET_CHORD_SIZE, "args": ["g1", 2], "kwargs": {}, "id": "c1"}


def test_calls_are_made_once_before_the_rows_are_published() -> None:
    """Both header rows go out; the chord size was set once, before either."""
    backend, inner = Backend(), Inner()
    publisher = ChordPublisher(inner, App(backend))
    attempts = publisher.publish(
        [message(1, [SIZE]), message(2, None), message(3, [SIZE])], lambda: False
    )
    assert [a.result for a in attempts] == [Result.PUBLISHED] * 3
    assert backend.sizes == [("g1", 2)]
    assert [m.row.id for m in inner.sent] == [1, 2, 3]


def test_an_unreachable_backend_holds_the_rows_as_an_outage() -> None:
    """Connection refused: the chord's rows are an outage (retries unspent); others go out."""
    backend, inner = Backend(), Inner()
    backend.error = redis.ConnectionError("Connection refused")
    publisher = ChordPublisher(inner, App(backend))
    attempts = publisher.publish([message(1, [SIZE]), message(2, None)], lambda: False)
    assert [a.result for a in attempts] == [Result.OUTAGE, Result.PUBLISHED]
    assert "result backend" in (attempts[0].error or "")
    assert [m.row.id for m in inner.sent] == [2]
    backend.error = None  # back up: the next attempt makes the call and publishes
    again = publisher.publish([message(1, [SIZE])], lambda: False)
    assert [a.result for a in again] == [Result.PUBLISHED]
    assert backend.sizes == [("g1", 2)]


def test_a_call_that_fails_otherwise_is_that_rows_failure() -> None:
    """An error that is not an outage spends a retry, like a message the broker refuses."""
    backend = Backend()
    backend.error = ValueError("bad size")
    attempts = ChordPublisher(Inner(), App(backend)).publish([message(1, [SIZE])], lambda: False)
    assert [a.result for a in attempts] == [Result.FAILED]
