"""In-process relaying for users' tests: the real relay code path, an in-memory broker.

The store here runs the relay's own named queries on Django's connection inside a
savepoint, so it sees rows the test wrote in its still-open transaction, and the recording
publisher stands where the broker would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import connections, transaction

from outbox_notify import conf, sql
from outbox_notify.events.envelope import CONTENT_TYPE, Envelope, decode
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.runner import reporters
from outbox_notify.relay.store import (
    ClaimedRow,
    Outcome,
    Peek,
    QueueGauges,
    claimed_rows,
    finalize_params,
    gauge_params,
    gauges_from,
)
from outbox_notify.serialization import SCHEMA_VERSION


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedMessage:
    """A message the fake relay published: what a worker would have received."""

    task_id: str
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    properties: dict[str, Any]
    exchange: str
    routing_key: str | None
    # A domain event (outbox_notify.events.publish): the CloudEvent its consumers receive.
    # task_id and task_name are then the event's id and type, args and kwargs empty.
    event: Envelope | None = None


class RecordingPublisher:
    """A Publisher that keeps every message in memory instead of sending it."""

    def __init__(self) -> None:
        self.published: list[PublishedMessage] = []

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Record each message; all succeed."""
        for message in messages:
            self.published.append(_published(message))
        return [Attempt(Result.PUBLISHED)] * len(messages)

    def check(self) -> None:
        """Always reachable."""

    def close(self) -> None:
        """Nothing to close."""


def _published(message: OutgoingMessage) -> PublishedMessage:
    event = decode(message.body) if message.content_type == CONTENT_TYPE else None
    if event is not None:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
    else:
        body = json.loads(message.body) if isinstance(message.body, str) else list(message.body)
        args, kwargs = list(body[0]), dict(body[1])
    exchange = message.spec.exchange
    return PublishedMessage(
        task_id=message.row.task_id,
        task_name=message.row.task_name,
        args=args,
        kwargs=kwargs,
        headers=dict(message.headers),
        properties=dict(message.spec.properties),
        exchange=exchange if isinstance(exchange, str) else exchange.name,
        routing_key=message.spec.routing_key,
        event=event,
    )


class SavepointClaim:
    """A claim held inside a savepoint of the test's transaction."""

    def __init__(self, store: SavepointStore, rows: list[ClaimedRow]) -> None:
        self.store = store
        self.rows = rows
        self.finished = False

    def finish(self, outcome: Outcome) -> None:
        """Apply the outcome (the savepoint is released when the claim block ends)."""
        self.store.apply(outcome)
        self.finished = True


class SavepointStore:
    """The relay's claim store, on Django's connection and inside savepoints."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.queries = sql.queries()

    def connect(self) -> None:
        """Django's connection is already there."""

    def close(self) -> None:
        """Django owns the connection."""

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[SavepointClaim]:
        """Claim rows inside a savepoint; an exception rolls the savepoint back.

        Every claim reads the table from its start (a new relay's frontier): the test's rows
        share the test's one transaction, so the frontier a relay keeps between transactions
        has nothing to go by, and a test's table holds few rows.
        """
        params = {**Frontier().params(), "limit": limit, "max_version": SCHEMA_VERSION}
        with transaction.atomic(using=self.alias), connections[self.alias].cursor() as cursor:
            cursor.execute(self.queries["claim_batch"], params)
            rows, _, _ = claimed_rows(cursor.fetchall(), limit)
            yield SavepointClaim(self, rows)

    def apply(self, outcome: Outcome) -> None:
        """Run the finalising statement of a batch."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(self.queries["finalize_batch"], finalize_params(outcome))

    def peek(self) -> Peek:
        """Nothing waits in tests: report claimable work only."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(
                self.queries["peek"], {**Frontier().params(), "max_version": SCHEMA_VERSION}
            )
            claimable, due, next_due_in = cursor.fetchone()
        return Peek(claimable=bool(claimable), due=bool(due), next_due_in=next_due_in)

    def queue_gauges(self) -> QueueGauges:
        """Queue depth and oldest pending age, through the relay's own gauge query."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(self.queries["queue_gauges"], {**Frontier().params(), **gauge_params()})
            return gauges_from(cursor.fetchone())

    def send_probe(self, payload: str) -> None:
        """NOTIFY the probe channel inside the test's transaction (sent if it ever commits)."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(self.queries["notify_probe"], {"payload": payload})

    def session_proven(self) -> None:
        """Nothing to do: the test's own connection is Django's."""


class FakeRelay:
    """Drains the outbox through the real relay loop into a RecordingPublisher."""

    def __init__(self, config: RelayConfig | None = None) -> None:
        self.publisher = RecordingPublisher()
        self.relay = Relay(
            config or RelayConfig(),
            store=SavepointStore(conf.database_alias()),
            listener=None,
            publisher=self.publisher,
            reporters=reporters(),  # the same signals (and Sentry reports) as a real relay
        )

    @property
    def published(self) -> list[PublishedMessage]:
        """Everything published so far, in order."""
        return self.publisher.published

    def drain(self) -> list[PublishedMessage]:
        """Publish every due row; return the messages this call published."""
        before = len(self.publisher.published)
        self.relay.drain()
        return self.publisher.published[before:]
