"""The overlapped drain: the next batch is claimed and written while the previous one awaits
its confirms (a publisher with `start()`, RabbitMQ's), on a second claim connection.

Two FakeStores share one table here the way two PostgreSQL sessions do: a claim skips the
rows the other connection's open claim holds (FOR UPDATE SKIP LOCKED).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from outbox_notify.exceptions import BrokerUnavailable, DatabaseUnavailable
from outbox_notify.fakes import OPTIONS, FakeClock, InMemoryClaim, RecordingMetrics
from outbox_notify.fakes import claimed_row as row
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import Attempt, PublishDeadline, Result
from outbox_notify.relay.store import ClaimedRow, ClaimWouldWait, Outcome, QueueGauges


class Table:
    """The outbox rows both claim connections see, and what happened to them, in order."""

    def __init__(self, count: int) -> None:
        self.rows = [row(n) for n in range(1, count + 1)]
        self.held: dict[str, set[int]] = {}
        self.log: list[str] = []
        self.fail_finish_of: int | None = None  # the claim number whose finish breaks
        self.locked_for = 0  # claims made beside another that find the table locked


class SharedStore:
    """One claim connection on the shared table."""

    def __init__(self, table: Table, name: str) -> None:
        self.table = table
        self.name = name
        self.claims = 0

    def connect(self) -> None: ...
    def close(self) -> None: ...

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[InMemoryClaim]:
        table = self.table
        if table.locked_for and lock_wait is not None:
            table.log.append(f"claim {self.name} would wait")
            table.locked_for -= 1
            raise ClaimWouldWait("lock timeout")
        others = set().union(*(ids for name, ids in table.held.items() if name != self.name))
        rows = [r for r in table.rows if r.id not in others][:limit]
        table.held[self.name] = {r.id for r in rows}
        number = sum(1 for line in table.log if line.startswith("claim ")) + 1
        table.log.append(f"claim {self.name} {[r.id for r in rows]}")
        claim = _Claim(self, rows, number)
        try:
            yield claim
        except BaseException:
            table.log.append(f"rollback {self.name}")
            raise
        finally:
            table.held[self.name] = set()
        if claim.outcome is not None:
            gone = set(claim.outcome.published) | {d.id for d in claim.outcome.dead}
            table.rows = [r for r in table.rows if r.id not in gone]
            table.log.append(f"commit {self.name} {sorted(claim.outcome.published)}")
        elif rows:
            table.log.append(f"release {self.name}")

    def peek(self) -> Any: ...

    def queue_gauges(self) -> QueueGauges:
        return QueueGauges(depth=len(self.table.rows), oldest_seconds=0.0)

    def send_probe(self, payload: str) -> None: ...

    def session_proven(self) -> None: ...


class _Claim(InMemoryClaim):
    def __init__(self, store: SharedStore, rows: list[ClaimedRow], number: int) -> None:
        super().__init__(rows)
        self.store = store
        self.number = number

    def finish(self, outcome: Outcome) -> None:
        if self.store.table.fail_finish_of == self.number:
            raise DatabaseUnavailable("the claim connection broke")
        super().finish(outcome)


class OverlappingPublisher:
    """Writes on start(), answers on wait(); logs both, and the deadlines it was given."""

    overlapping = True

    def __init__(self, table: Table, answer: Callable[[OutgoingMessage], Attempt]) -> None:
        self.table = table
        self.answer = answer
        self.deadlines: list[PublishDeadline] = []
        self.cancelled = 0
        self.check_error: str | None = None
        self.connected = True  # can_overlap(): no reconnect needed

    def can_overlap(self) -> bool:
        return self.connected

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        return self.start(messages, deadline).wait()

    def start(self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Any:
        assert isinstance(deadline, PublishDeadline)
        self.deadlines.append(deadline)
        ids = [m.row.id for m in messages]
        self.table.log.append(f"write {ids}")
        publisher = self

        class Pending:
            def wait(self) -> list[Attempt]:
                publisher.table.log.append(f"confirms {ids}")
                return [publisher.answer(m) for m in messages]

            def cancel(self) -> None:
                publisher.cancelled += 1

        return Pending()

    def check(self) -> None:
        if self.check_error is not None:
            raise BrokerUnavailable(self.check_error)

    def close(self) -> None: ...


def overlapped(table: Table, publisher: OverlappingPublisher, **config: Any) -> Relay:
    return Relay(
        RelayConfig(**{"batch_size": 2, **config}),
        store=SharedStore(table, "a"),
        spare_store=SharedStore(table, "b"),
        listener=None,
        publisher=publisher,
        clock=FakeClock(),
    )


def published() -> Callable[[OutgoingMessage], Attempt]:
    return lambda m: Attempt(Result.PUBLISHED)


def test_the_next_batch_is_claimed_and_written_before_the_previous_one_is_finalised() -> None:
    """Claims alternate between the two connections, never hold the same rows, and commit in
    the order they were claimed; each batch's write precedes the previous batch's confirms."""
    table = Table(5)
    relay = overlapped(table, OverlappingPublisher(table, published()))
    assert relay.drain() is True
    assert relay.drained == 5
    assert table.rows == []
    assert table.log == [
        "claim a [1, 2]",
        "write [1, 2]",
        "claim b [3, 4]",
        "write [3, 4]",
        "confirms [1, 2]",
        "commit a [1, 2]",
        "claim a [5]",
        "write [5]",
        "confirms [3, 4]",
        "commit b [3, 4]",
        "confirms [5]",
        "commit a [5]",
    ]


def test_a_short_batch_ends_the_drain_without_claiming_again() -> None:
    """As in the plain drain: a batch that came back short means the table is drained."""
    table = Table(1)
    relay = overlapped(table, OverlappingPublisher(table, published()))
    assert relay.drain() is True
    assert table.log == ["claim a [1]", "write [1]", "confirms [1]", "commit a [1]"]


def test_the_next_batch_must_end_its_broker_steps_within_the_previous_claims_budget() -> None:
    """Waiting for the second batch must not make the first claim outlive --stale-timeout."""
    table = Table(4)
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher, stale_timeout=30.0)
    clock = relay.clock
    assert isinstance(clock, FakeClock)
    first_claim = clock.now
    original = publisher.start

    def later(messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Any:
        pending = original(messages, deadline)
        clock.now += 5.0  # the second claim begins 5 s after the first
        return pending

    publisher.start = later  # type: ignore[method-assign]
    relay.drain()
    first, second = publisher.deadlines[:2]
    assert first.claim_end == pytest.approx(first_claim + 27.0)
    # Its own budget would end at first_claim + 5 + 27; the first claim's ends sooner.
    assert second.claim_end == pytest.approx(first_claim + 27.0)


def test_an_outage_ends_the_drain_and_still_finalises_the_batch_in_flight() -> None:
    """Both batches' rows are released with their retries unspent; nothing is claimed after."""
    table = Table(6)
    publisher = OverlappingPublisher(table, lambda m: Attempt(Result.OUTAGE, "blocked"))
    relay = overlapped(table, publisher)
    assert relay.drain() is False
    assert [line for line in table.log if line.startswith("claim")] == [
        "claim a [1, 2]",
        "claim b [3, 4]",
    ]
    assert table.log[-2:] == ["confirms [3, 4]", "commit b []"]  # nothing published
    assert len(table.rows) == 6
    assert relay.breaker.failures == 1  # one outage of the broker, not one per batch


def test_a_broker_lost_with_a_batch_in_flight_finalises_it_before_checking() -> None:
    """The connection is gone after the first batch was written: that batch is awaited and
    committed with no claim beside it, then the check before the next claim fails."""
    table = Table(4)
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher)
    original = publisher.start

    def then_unreachable(messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Any:
        publisher.check_error = "connection refused"
        publisher.connected = False
        return original(messages, deadline)

    publisher.start = then_unreachable  # type: ignore[method-assign]
    assert relay.drain() is False
    assert table.log == ["claim a [1, 2]", "write [1, 2]", "confirms [1, 2]", "commit a [1, 2]"]
    assert relay.breaker.failures == 1


def test_a_database_failure_on_one_connection_lets_the_other_batch_finish() -> None:
    """Finalising the first batch breaks: its claim is rolled back (its rows stay in the table
    for a later drain); the second batch, on the other connection, is finalised as usual."""
    table = Table(4)
    table.fail_finish_of = 1
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher)
    with pytest.raises(DatabaseUnavailable):
        relay.drain()
    # The batch on the healthy connection is still awaited and committed: one duplicate
    # batch (the rolled-back one) instead of two.
    assert table.log[-3:] == ["rollback a", "confirms [3, 4]", "commit b [3, 4]"]
    assert [r.id for r in table.rows] == [1, 2]
    assert table.held == {"a": set(), "b": set()}


def test_a_stop_requested_meanwhile_claims_nothing_more() -> None:
    """After a stop, the batch in flight is finalised and no further claim is made."""
    table = Table(6)
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher)
    original = publisher.start

    def stop_after_first(messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Any:
        relay.request_stop()
        return original(messages, deadline)

    publisher.start = stop_after_first  # type: ignore[method-assign]
    relay.drain()
    assert table.log == ["claim a [1, 2]", "write [1, 2]", "confirms [1, 2]", "commit a [1, 2]"]


def test_without_a_second_connection_the_drain_stays_one_batch_at_a_time() -> None:
    """A relay built without a spare store (Redis, kombu) awaits each batch before the next."""
    table = Table(3)
    relay = Relay(
        RelayConfig(batch_size=2),
        store=SharedStore(table, "a"),
        listener=None,
        publisher=OverlappingPublisher(table, published()),
        clock=FakeClock(),
    )
    relay.drain()
    assert table.log == [
        "claim a [1, 2]",
        "write [1, 2]",
        "confirms [1, 2]",
        "commit a [1, 2]",
        "claim a [3]",
        "write [3]",
        "confirms [3]",
        "commit a [3]",
    ]


def test_an_error_that_is_not_the_databases_rolls_back_both_and_forgets_the_confirms() -> None:
    """Anything else (a bug, a KeyboardInterrupt) ends both claims untouched at once."""
    table = Table(4)
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher)
    relay.policy.decide = _explode  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="bug"):
        relay.drain()
    assert table.log[-2:] == ["rollback a", "rollback b"]
    assert publisher.cancelled == 1
    assert len(table.rows) == 4
    assert table.held == {"a": set(), "b": set()}


def _explode(*args: Any) -> Any:
    raise RuntimeError("bug")


def test_no_overlap_while_the_publisher_would_have_to_reconnect() -> None:
    """A lost or blocked broker connection: the batch in flight is finalised first, so a
    reconnect never happens while another claim waits."""
    table = Table(3)
    publisher = OverlappingPublisher(table, published())
    publisher.connected = False
    overlapped(table, publisher).drain()
    assert table.log == [
        "claim a [1, 2]",
        "write [1, 2]",
        "confirms [1, 2]",
        "commit a [1, 2]",
        "claim b [3]",
        "write [3]",
        "confirms [3]",
        "commit b [3]",
    ]


def test_no_overlap_when_the_previous_claim_has_less_than_a_step_left() -> None:
    """The next batch is started only while the previous claim can still outwait one broker
    step of it (claims that ran long are finalised first)."""
    table = Table(3)
    publisher = OverlappingPublisher(table, published())
    relay = overlapped(table, publisher, stale_timeout=30.0, send_timeout=10.0)
    clock = relay.clock
    assert isinstance(clock, FakeClock)
    original = publisher.start

    def slow(messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Any:
        clock.now += 8.0  # 27 s budget - 8 s = 19 s left, under the 20 s step worst case
        return original(messages, deadline)

    publisher.start = slow  # type: ignore[method-assign]
    relay.drain()
    assert table.log.index("commit a [1, 2]") < table.log.index("claim b [3]")


def test_a_batch_with_result_backend_calls_waits_until_the_previous_one_is_finalised() -> None:
    """Chord calls have no deadline of their own: they never run while another claim waits."""
    table = Table(3)
    chord = json.loads(OPTIONS)
    chord["backend_calls"] = [{"call": "set_chord_size", "args": ["g", 2]}]
    table.rows[2] = row(3, options=json.dumps(chord))
    overlapped(table, OverlappingPublisher(table, published())).drain()
    assert table.log == [
        "claim a [1, 2]",
        "write [1, 2]",
        "claim b [3]",
        "confirms [1, 2]",
        "commit a [1, 2]",
        "write [3]",
        "confirms [3]",
        "commit b [3]",
    ]


class GaugedStore(SharedStore):
    """Fails like psycopg when gauges are sampled on a connection inside a claim."""

    def queue_gauges(self) -> QueueGauges:
        if self.table.held.get(self.name):
            raise DatabaseUnavailable("can't change 'autocommit' now: INTRANS")
        self.table.log.append(f"gauges {self.name}")
        return QueueGauges(depth=len(self.table.rows), oldest_seconds=0.0)


def test_gauges_are_never_sampled_beside_an_open_claim() -> None:
    """With metrics on, gauges are read only when no claim is open (a gauge query beside a
    claim could queue behind a lock request that waits for that claim)."""
    table = Table(9)
    relay = Relay(
        RelayConfig(batch_size=2),
        store=GaugedStore(table, "a"),
        spare_store=GaugedStore(table, "b"),
        listener=None,
        publisher=OverlappingPublisher(table, published()),
        clock=FakeClock(),
        metrics=RecordingMetrics(),
    )
    relay.GAUGE_INTERVAL = 0.0  # sample whenever the drain may
    assert relay.drain() is True
    assert table.rows == []
    assert "gauges a" in table.log


def test_a_claim_that_would_wait_for_the_table_finalises_the_one_in_flight_first() -> None:
    """A TRUNCATE queued behind the claim in flight locks the table for the next claim: it
    gives up instead of waiting (the relay would wait for itself), the claim in flight is
    finalised, and claiming goes on one batch at a time until the table is free."""
    table = Table(5)
    table.locked_for = 1
    overlapped(table, OverlappingPublisher(table, published())).drain()
    assert table.log[:7] == [
        "claim a [1, 2]",
        "write [1, 2]",
        "claim b would wait",
        "confirms [1, 2]",
        "commit a [1, 2]",
        "claim b [3, 4]",
        "write [3, 4]",
    ]
    assert table.rows == []
