"""The sleep decision table, driven with fakes: lock held / peer / writers x notified / timer /
signal, and what each costs in statements. No database, no Django settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from outbox_notify.fakes import (
    FakeClock,
    FakeListener,
    InMemoryStore,
    ScriptedPublisher,
    publishes_all,
)
from outbox_notify.fakes import claimed_row as row
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.listener import LockState, Outwait, Wake
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.publisher import Attempt, Result

SWEEP = 2.0  # seconds: the relay's --sweep-interval in these tests
LOCK_WAIT = 0.05  # seconds: its --lock-wait


def sleeper(listener_options: dict[str, Any] | None = None, rows: int = 0) -> Relay:
    """A listening relay on fakes, ready to sleep (as after a drain that found nothing)."""
    clock = FakeClock()
    store = InMemoryStore([row(n) for n in range(1, rows + 1)])
    listener = FakeListener(clock=clock, store=store, lock_wait=LOCK_WAIT)
    for name, value in (listener_options or {}).items():
        setattr(listener, name, value)
    relay = Relay(
        RelayConfig(sweep_interval=SWEEP, lock_wait=LOCK_WAIT),
        store=store,
        listener=listener,
        publisher=publishes_all(),
        clock=clock,
    )
    relay.polling = False
    return relay


def fake(relay: Relay) -> FakeListener:
    assert isinstance(relay.listener, FakeListener)
    return relay.listener


def published(relay: Relay) -> list[Any]:
    """The messages the relay's publisher was handed, in order."""
    assert isinstance(relay.publisher, ScriptedPublisher)
    return relay.publisher.messages


def store(relay: Relay) -> InMemoryStore:
    assert isinstance(relay.store, InMemoryStore)
    return relay.store


def after(relay: Relay, seconds: float, then: Callable[[], None]) -> None:
    """Run `then` after the first statement at least `seconds` (fake time) into the sleep."""
    listener = fake(relay)
    start = listener.clock.now
    done = False

    def hook(name: str) -> None:
        nonlocal done
        if not done and listener.clock.now - start >= seconds:
            done = True
            then()

    listener.on_statement = hook


def silent_after_peek(listener: FakeListener, seconds: float) -> None:
    """The LISTEN connection says nothing for `seconds` after each peek (a long sleep)."""

    def hook(name: str) -> None:
        if name == "peek":
            listener.clock.now += seconds

    listener.on_statement = hook


def stop_after(relay: Relay, seconds: float) -> None:
    """Request a stop (as SIGTERM would) `seconds` into the sleep."""
    after(relay, seconds, relay.request_stop)


# -- the lock is held: this relay sleeps -------------------------------------------------


def test_held_and_notified_keeps_the_lock_and_returns_to_drain() -> None:
    """Asleep with the lock, a notification ends the sleep; the lock is kept for the drain."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    relay.sleep_until_work()
    assert fake(relay).released == 0
    assert fake(relay).holds_lock
    assert [n for _, n in fake(relay).statements] == ["take_lock", "peek"]


def test_a_short_drain_after_a_wake_sleeps_again_without_releasing_or_taking_the_lock() -> None:
    """Woken for one row: claim it, then peek and sleep on the lock still held (two statements
    fewer per wake than releasing it on waking and taking it again after the drain)."""
    relay = sleeper({"waits": [Wake.NOTIFIED, Wake.SIGNAL]})
    listener = fake(relay)
    relay.sleep_until_work()  # woken by the notification, lock kept
    store(relay).rows.append(row(1))
    relay.cycle()  # drains the row, then sleeps again until the signal
    assert [m.row.id for m in published(relay)] == [1]
    assert [n for _, n in listener.statements] == ["take_lock", "peek", "peek", "release_lock"]
    assert listener.named("take_lock") == 1


@pytest.mark.parametrize("rows", [Relay.LINGER_THRESHOLD, 150])
def test_a_busy_drain_after_a_wake_lets_go_of_the_lock(rows: int) -> None:
    """A drain that finds enough rows to linger (or a full batch: a backlog) releases the lock
    kept from the wake, so writers stop notifying while the relay is busy."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    listener = fake(relay)
    relay.sleep_until_work()
    released_at: list[int] = []
    original = listener.release_lock

    def release() -> None:
        released_at.append(len(published(relay)))
        original()

    listener.release_lock = release  # type: ignore[method-assign]
    store(relay).rows.extend(row(n) for n in range(1, rows + 1))
    relay.cycle()
    assert not listener.holds_lock
    assert listener.released == 1
    if rows > relay.config.batch_size:
        assert released_at[0] == relay.config.batch_size  # after the first full batch
    else:
        assert released_at[0] == rows  # after the drain, before lingering


@pytest.mark.parametrize("bounded", [True, False])
def test_a_wake_after_a_long_silence_keeps_the_lock_only_without_an_idle_session_timeout(
    bounded: bool,
) -> None:
    """On PostgreSQL 14+ the session holding the lock ends after --stale-timeout of silence.
    Woken after a long sleep, a drain that publishes up to its budget could outlast it: the
    relay then lets go of the lock at once (without the timeout it keeps it)."""
    relay = sleeper({"waits": [Wake.NOTIFIED], "bounded": bounded})
    listener = fake(relay)
    silent_after_peek(listener, relay.config.stale_timeout - relay.config.publish_budget)
    relay.sleep_until_work()
    assert listener.holds_lock is not bounded
    assert listener.released == (1 if bounded else 0)


def test_a_wake_soon_after_the_last_statement_keeps_the_lock_with_the_timeout() -> None:
    """Just under the margin the lock is kept: the guard costs nothing at the rates it is for."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    listener = fake(relay)
    margin = (relay.config.stale_timeout - relay.config.publish_budget) / 2
    silent_after_peek(listener, margin - 0.01)
    relay.sleep_until_work()
    assert listener.holds_lock


def test_an_outage_after_a_wake_lets_go_of_the_lock() -> None:
    """The broker refuses the drain's batch: the relay lets go before its cooldown."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    relay.publisher = ScriptedPublisher(lambda m: Attempt(Result.OUTAGE, "broker down"))
    relay.sleep_until_work()
    store(relay).rows.append(row(1))
    relay.cycle()
    assert not fake(relay).holds_lock
    assert fake(relay).released == 1


def test_a_stop_after_a_wake_lets_go_of_the_lock() -> None:
    """A stop requested while the lock is kept: the next cycle lets go and claims nothing."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    relay.sleep_until_work()
    relay.request_stop()
    relay.cycle()
    assert not fake(relay).holds_lock
    assert store(relay).claims == 0


def test_an_overlapped_drain_lets_go_of_the_lock_before_claiming() -> None:
    """A publisher with batches in flight (RabbitMQ's confirms) never drains briefly."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    relay.sleep_until_work()
    relay.spare_store = InMemoryStore([])
    relay.publisher.overlapping = True  # type: ignore[attr-defined]
    claims_at_release: list[int] = []
    listener = fake(relay)
    original = listener.release_lock

    def release() -> None:
        claims_at_release.append(store(relay).claims)
        original()

    listener.release_lock = release  # type: ignore[method-assign]
    relay.drain()
    assert claims_at_release[:1] == [0]
    assert not listener.holds_lock


def test_held_timer_keeps_the_lock_and_peeks_once_per_sweep_interval() -> None:
    """A timer wake with nothing to do keeps the lock and costs one peek per sweep interval."""
    relay = sleeper()
    stop_after(relay, 10 * SWEEP - 0.001)
    relay.sleep_until_work()
    listener = fake(relay)
    assert listener.named("take_lock") == 1
    assert listener.named("peek") == 1 + 10  # on taking the lock, then at each timer wake
    assert listener.released == 1  # only on the way out


def test_held_and_signal_returns_and_releases_the_lock() -> None:
    """A stop signal during the sleep ends it, lock released."""
    relay = sleeper({"waits": [Wake.SIGNAL]})
    relay.sleep_until_work()
    assert fake(relay).released == 1
    assert not fake(relay).holds_lock


def test_held_with_a_row_already_committed_never_waits() -> None:
    """The peek after taking the lock finds a row that committed before: drain at once."""
    relay = sleeper(rows=1)
    relay.sleep_until_work()
    assert [n for _, n in fake(relay).statements] == ["take_lock", "peek"]
    assert fake(relay).holds_lock  # kept for the drain
    assert fake(relay).clock.now == 1000.0


# -- another relay sleeps with the lock ----------------------------------------------------


@pytest.mark.parametrize("wake", [Wake.NOTIFIED, Wake.SIGNAL, Wake.TIMEOUT])
def test_peer_returns_after_one_wait_whatever_woke_it(wake: Wake) -> None:
    """Behind a sleeping peer, every wake (even the timer) returns, to retry the lock."""
    relay = sleeper({"locks": [LockState.PEER], "waits": [wake]})
    relay.sleep_until_work()
    listener = fake(relay)
    assert [n for _, n in listener.statements] == ["take_lock", "peek"]
    assert listener.released == 0
    if wake is Wake.TIMEOUT:
        assert listener.clock.now == pytest.approx(1000.0 + LOCK_WAIT + SWEEP)


# -- writers' open transactions hold the lock ----------------------------------------------


def test_writers_commit_hands_over_the_lock_and_their_rows_are_drained_at_once() -> None:
    """Queued behind a writer, the relay gets the lock at its commit and finds its row."""
    relay = sleeper({"locks": [LockState.WRITERS]})
    listener = fake(relay)
    listener.outwaits = [Outwait.TIMED_OUT] * 40 + [Outwait.LOCKED]

    def commit(name: str) -> None:
        if name == "await_writers" and listener.holds_lock:
            store(relay).rows.append(row(99))  # the writer's row, visible from its commit

    listener.on_statement = commit
    relay.sleep_until_work()
    names = [n for _, n in listener.statements]
    assert names[-2:] == ["await_writers", "peek"]  # nothing in between
    assert listener.holds_lock  # kept for the drain of the writer's row
    assert store(relay).claims == 0  # never re-drained while waiting


def test_writers_cost_one_statement_per_lock_wait_and_no_claims() -> None:
    """While writers hold the lock for 10 s: one statement per --lock-wait, a holder check per
    sweep interval, and no claims at all (it used to re-drain every 50 ms)."""
    relay = sleeper({"locks": [LockState.WRITERS]})
    stop_after(relay, 10.0)
    while not relay.stopping:  # Relay.run() without the connecting
        relay.cycle()
    listener = fake(relay)
    elapsed = listener.clock.now - 1000.0
    assert elapsed == pytest.approx(10.0 + LOCK_WAIT, abs=2 * LOCK_WAIT)
    waits = listener.named("await_writers")
    assert waits <= elapsed / LOCK_WAIT + 1
    assert listener.named("lock_holder") == pytest.approx(10.0 / SWEEP, abs=1)
    assert listener.named("take_lock") == 1
    assert store(relay).claims == 1  # the drain before the sleep, then none
    assert listener.released == 0


def test_writers_and_another_writers_notification_returns_to_drain() -> None:
    """A writer arriving meanwhile notifies (the relay is queued); the relay drains for it."""
    relay = sleeper({"locks": [LockState.WRITERS]})
    listener = fake(relay)
    after(relay, 0.5, lambda: setattr(listener, "pending", 1))
    relay.sleep_until_work()
    assert listener.clock.now - 1000.0 == pytest.approx(0.5 + LOCK_WAIT, abs=LOCK_WAIT)
    assert not listener.holds_lock


def test_writers_and_a_claimable_row_returns_to_drain_without_queueing() -> None:
    """A row claimable now (a retry fell due, a commit seen by no one) ends the wait."""
    relay = sleeper({"locks": [LockState.WRITERS], "outwaits": [Outwait.CLAIMABLE]})
    relay.sleep_until_work()
    listener = fake(relay)
    assert [n for _, n in listener.statements] == ["take_lock", "await_writers"]
    assert not listener.holds_lock


def test_writers_and_a_signal_stop_within_one_lock_wait() -> None:
    """SIGTERM while queued behind writers: the relay returns after the statement in hand."""
    relay = sleeper({"locks": [LockState.WRITERS]})
    stop_after(relay, 1.0)
    relay.sleep_until_work()
    assert fake(relay).clock.now - 1000.0 == pytest.approx(1.0 + LOCK_WAIT, abs=2 * LOCK_WAIT)


def test_writers_then_a_peer_took_the_lock_sleeps_as_a_peer() -> None:
    """When the writers finished and another relay took the lock, it sleeps on LISTEN."""
    relay = sleeper(
        {"locks": [LockState.WRITERS], "holders": [LockState.PEER], "waits": [Wake.NOTIFIED]}
    )
    relay.sleep_until_work()
    listener = fake(relay)
    names = [n for _, n in listener.statements]
    assert names[-2:] == ["lock_holder", "peek"]
    assert names.count("await_writers") == pytest.approx(SWEEP / LOCK_WAIT, abs=1)
    assert listener.released == 0
