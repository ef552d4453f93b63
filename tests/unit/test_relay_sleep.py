"""The sleep decision table, driven with fakes: lock held / peer / writers x notified / timer /
signal, and what each costs in statements. No database, no Django settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from outbox_notify.fakes import FakeClock, FakeListener, InMemoryStore, publishes_all
from outbox_notify.fakes import claimed_row as row
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.listener import LockState, Outwait, Wake
from outbox_notify.relay.loop import Relay

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


def stop_after(relay: Relay, seconds: float) -> None:
    """Request a stop (as SIGTERM would) `seconds` into the sleep."""
    after(relay, seconds, relay.request_stop)


# -- the lock is held: this relay sleeps -------------------------------------------------


def test_held_and_notified_releases_the_lock_and_returns_to_drain() -> None:
    """Asleep with the lock, a notification ends the sleep and gives the lock back."""
    relay = sleeper({"waits": [Wake.NOTIFIED]})
    relay.sleep_until_work()
    assert fake(relay).released == 1
    assert [n for _, n in fake(relay).statements] == ["take_lock", "peek", "release_lock"]


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
    assert [n for _, n in fake(relay).statements] == ["take_lock", "peek", "release_lock"]
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
    assert names[-3:] == ["await_writers", "peek", "release_lock"]  # nothing in between
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
