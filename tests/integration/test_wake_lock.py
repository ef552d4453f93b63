"""The wake lock in practice: a frozen sleeper loses it (PostgreSQL 14+), an idle relay
peeks once per sweep interval, and relays outwait a writer that holds it without spinning."""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from outbox_notify.relay.config import CLAIM_APPLICATION_NAME, LISTEN_APPLICATION_NAME
from outbox_notify.relay.listener import Listener, LockState, Outwait
from outbox_notify.relay.runner import connection_kwargs
from tests.celery_app import add
from tests.integration.test_relay import enqueue, insert_raw, ready
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay is another process; the lock and its release are server state.


def wake_lock_holders() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1869968482"
            " AND objid = 1 AND objsubid = 2 AND granted AND mode = 'ExclusiveLock'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return int(cursor.fetchone()[0])


def test_frozen_sleeping_relay_loses_the_wake_lock(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """SIGSTOP a relay asleep with the lock: after --stale-timeout the server frees the lock."""
    if connection.pg_version < 140000:
        pytest.skip("idle_session_timeout needs PostgreSQL 14")  # never on CI's PostgreSQL 15
    relay = start_relay("--sweep-interval", "1", "--stale-timeout", "3", "--send-timeout", "1")
    ready(relay)
    wait_for(
        lambda: wake_lock_holders() == 1,
        what="the relay asleep with the lock",
        context=relay.output,
    )
    relay.signal(signal.SIGSTOP)
    try:
        wait_for(
            lambda: wake_lock_holders() == 0,
            timeout=30,
            what="the lock freed",
            context=relay.output,
        )
    finally:
        relay.signal(signal.SIGCONT)
    # Resumed, it finds its session gone, reconnects and sleeps with the lock again.
    wait_for(
        lambda: relay.output().count("outbox.database_connected") >= 2,
        what="a reconnect",
        context=relay.output,
    )
    time.sleep(0.2)
    wait_for(lambda: wake_lock_holders() == 1, what="the lock retaken", context=relay.output)


def test_an_idle_relay_makes_one_query_per_sweep_interval(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """Asleep with nothing to do, a relay keeps its lock and only peeks once per sweep interval.

    Watched through pg_stat_activity, which shows each backend's current statement at once;
    database-wide counters would also count autovacuum and statistics flushed late.
    """
    relay = start_relay("--sweep-interval", "0.5")
    ready(relay)
    wait_for(lambda: wake_lock_holders() == 1, what="the relay asleep", context=relay.output)
    with psycopg.connect(**connection_kwargs("default"), autocommit=True) as watcher:
        rows = watcher.execute(
            "SELECT application_name, pid FROM pg_stat_activity"
            " WHERE application_name IN (%s, %s) AND datname = current_database()",
            (LISTEN_APPLICATION_NAME, CLAIM_APPLICATION_NAME),
        ).fetchall()
        pids = dict(rows)
        assert len(rows) == 2, rows
        assert set(pids) == {LISTEN_APPLICATION_NAME, CLAIM_APPLICATION_NAME}, rows
        peeks: set[Any] = set()
        others: list[str] = []
        claim_changes: set[Any] = set()
        holders: set[int] = set()
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            sample = watcher.execute(
                "SELECT a.pid, a.query_start, a.state_change, a.query,"
                " (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory'"
                "  AND l.classid = 1869968482 AND l.objid = 1 AND l.objsubid = 2"
                "  AND l.granted AND l.mode = 'ExclusiveLock'"
                "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))"
                " FROM pg_stat_activity a WHERE a.pid = ANY(%s)",
                (list(pids.values()),),
            ).fetchall()
            for pid, query_start, state_change, query, holder in sample:
                holders.add(holder)
                if pid == pids[CLAIM_APPLICATION_NAME]:
                    claim_changes.add(state_change)
                elif "claimable" in query:
                    peeks.add(query_start)
                else:
                    others.append(query)
            time.sleep(0.005)
    # The lock never changed hands, the claim connection said nothing, and the LISTEN
    # connection ran nothing but peeks: 12 sweep intervals in 6 s, with a margin for timing.
    assert holders == {pids[LISTEN_APPLICATION_NAME]}, holders
    assert len(claim_changes) == 1, f"the claim connection ran {len(claim_changes) - 1} statements"
    assert not others, f"statements other than the peek: {sorted(set(others))}"
    # One statement can show two query_start values: the server stamps the Parse and the
    # Bind/Execute messages of the extended protocol separately, a fraction of a ms apart.
    gaps = [round((b - a).total_seconds(), 3) for a, b in itertools.pairwise(sorted(peeks))]
    statements = 1 + sum(1 for gap in gaps if gap > 0.02) if peeks else 0
    assert 6 <= statements <= 12 + 2, f"{statements} peeks in 6 s, gaps {gaps}"


WAKE_LOCK_ARGS = "1869968482, 1"
WINDOW = 10.0  # seconds the writer keeps its transaction open once the burst is published
BURST = 300  # rows that wake both relays
STAMP_MERGE = 0.005  # seconds: Parse and Bind/Execute of one statement are stamped apart


def relay_backends(watcher: psycopg.Connection[Any], count: int) -> dict[int, str]:
    """{pid: application_name} of the relays' connections, once all `count` are there."""

    def backends() -> dict[int, str]:
        rows = watcher.execute(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE application_name IN (%s, %s) AND datname = current_database()",
            (LISTEN_APPLICATION_NAME, CLAIM_APPLICATION_NAME),
        ).fetchall()
        return dict(rows) if len(rows) == count else {}

    found: dict[int, str] = wait_for(backends, what=f"{count} relay connections")
    return found


class StatementCounter:
    """Counts the statements each relay backend starts, from pg_stat_activity.query_start."""

    def __init__(self, watcher: psycopg.Connection[Any], backends: dict[int, str]) -> None:
        self.watcher = watcher
        self.backends = backends
        self.stamps: dict[int, set[Any]] = {pid: set() for pid in backends}
        self.started = time.monotonic()

    def sample(self) -> None:
        rows = self.watcher.execute(
            "SELECT pid, query_start FROM pg_stat_activity WHERE pid = ANY(%s)",
            (list(self.backends),),
        ).fetchall()
        for pid, query_start in rows:
            if query_start is not None:
                self.stamps[pid].add(query_start)

    def statements(self, pid: int) -> int:
        """Distinct statements seen on one backend (stamps closer than STAMP_MERGE merged)."""
        stamps = sorted(self.stamps[pid])
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
        return max(0, sum(1 for gap in gaps if gap > STAMP_MERGE))

    def totals(self) -> dict[str, int]:
        """Statements summed by connection kind (listen, claim) over all relays."""
        totals = {LISTEN_APPLICATION_NAME: 0, CLAIM_APPLICATION_NAME: 0}
        for pid, name in self.backends.items():
            totals[name] += self.statements(pid)
        return totals


def test_a_long_writer_transaction_does_not_make_relays_spin(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """Two relays outwait a writer that holds the wake lock 10 s without spinning.

    The writer takes the lock's shared side while the relays are draining a burst (as a
    trigger does, so it will not notify), inserts, and keeps its transaction open. The relays
    must neither re-drain in a loop (the claim connections stay quiet) nor run more than one
    statement per --lock-wait on their LISTEN connections, and must still publish the
    writer's row once it commits, long before their 30 s sweep would.
    """
    # One-row batches: the relay asleep with the lock keeps it through the wake only until
    # its first full batch (BatchDrain.run), so the lock is free for the rest of the burst's
    # drain unless the other relay took all of it first. With 100-row batches the other relay
    # could take the whole burst before the holder's first claim, and the lock stayed with the
    # relay that found nothing, asleep again.
    args = (
        *("--sweep-interval", "30", "--stale-timeout", "60", "--lock-wait", "0.05"),
        *("--batch-size", "1"),
    )
    relays = [start_relay(*args) for _ in range(2)]
    for relay in relays:
        ready(relay)
    wait_for(lambda: wake_lock_holders() == 1, what="a relay asleep with the lock")
    with psycopg.connect(**connection_kwargs("default"), autocommit=True) as watcher:
        backends = relay_backends(watcher, 4)
        enqueue(redis_queue.name, BURST)  # wakes both relays
        with transaction.atomic():
            with connection.cursor() as cursor:
                wait_for(
                    lambda: cursor.execute(
                        f"SELECT pg_try_advisory_xact_lock_shared({WAKE_LOCK_ARGS})"
                    ).fetchone()[0],
                    interval=0.001,
                    what="the wake lock free (both relays draining)",
                    context=lambda: "".join(
                        f"--- relay {n} ---\n{relay.output()}" for n, relay in enumerate(relays)
                    ),
                )
            [task_id] = [add.apply_async((7, 7), queue=redis_queue.name).id]
            wait_for(
                lambda: len(redis_queue.task_ids()) == BURST,
                what="the burst published",
                context=relays[0].output,
            )
            # Markers in a server's statement log (bench/long_writer.py counts between them).
            watcher.execute("SELECT 'outbox-notify-window-start'")
            counter = StatementCounter(watcher, backends)
            while time.monotonic() - counter.started < WINDOW:
                counter.sample()
                time.sleep(0.002)
            totals, window = counter.totals(), time.monotonic() - counter.started
            watcher.execute("SELECT 'outbox-notify-window-end'")
        committed = time.monotonic()
        wait_for(
            lambda: redis_queue.client.llen(redis_queue.name) > BURST,
            timeout=15,
            interval=0.001,
            what="the writer's message after its commit",
            context=relays[0].output,
        )
        latency = time.monotonic() - committed
    assert redis_queue.task_ids()[-1] == task_id
    rates = {name: round(n / window, 1) for name, n in totals.items()}
    print(
        f"\nlong writer: window {window:.2f} s, statements/s {rates},"
        f" commit->publish {latency * 1000:.1f} ms"
    )
    # At most one statement per relay per --lock-wait (0.05 s), with a wide margin; the claim
    # connections at most finish the burst's drain (it used to claim every 50 ms or so).
    assert totals[LISTEN_APPLICATION_NAME] <= 2 * (window / 0.05) * 1.5, totals
    assert totals[CLAIM_APPLICATION_NAME] <= 10, totals


@pytest.fixture(params=[True, False], ids=["pg14-bounded", "pg13-unbounded"])
def lock_listener(request: pytest.FixtureRequest) -> Iterator[Listener]:
    """A connected, listening Listener; both forms of the wake-lock queries."""
    listener = Listener(connection_kwargs("default"), lock_wait=0.05, wake_fd=None)
    listener.connect()
    listener.listen()
    listener.bounded = request.param and listener.bounded
    yield listener
    listener.close()


@contextlib.contextmanager
def writer_holding_the_lock() -> Iterator[psycopg.Connection[Any]]:
    """A writer transaction holding the wake lock's shared side (as a trigger leaves it)."""
    with psycopg.connect(**connection_kwargs("default")) as writer:
        writer.execute(f"SELECT pg_advisory_xact_lock_shared({WAKE_LOCK_ARGS})")
        yield writer


def test_await_writers_times_out_while_a_writer_holds_the_lock(lock_listener: Listener) -> None:
    """Behind an open writer transaction, one await is one lock wait that ends TIMED_OUT."""
    with writer_holding_the_lock():
        assert lock_listener.take_lock() is LockState.WRITERS
        assert lock_listener.await_writers() is Outwait.TIMED_OUT
        assert lock_listener.lock_holder() is LockState.WRITERS
    assert wake_lock_holders() == 0


def test_await_writers_says_claimable_without_queueing(lock_listener: Listener) -> None:
    """A claimable row ends the wait at once, and the lock is not taken."""
    insert_raw(task_id="claimable")
    with writer_holding_the_lock():
        assert lock_listener.await_writers() is Outwait.CLAIMABLE
    assert wake_lock_holders() == 0
    assert not lock_listener.holds_lock


def test_await_writers_gets_the_lock_when_the_writer_commits(lock_listener: Listener) -> None:
    """The writer's commit during the wait hands the lock over: LOCKED, held until released."""
    with writer_holding_the_lock() as writer:
        assert lock_listener.conn is not None
        lock_listener.conn.execute("SET lock_timeout = '5s'")
        committer = threading.Timer(0.3, writer.commit)
        committer.start()
        try:
            assert lock_listener.await_writers() is Outwait.LOCKED
        finally:
            committer.join()
    assert wake_lock_holders() == 1
    assert lock_listener.lock_holder() is LockState.PEER  # what another relay would now see
    lock_listener.release_lock()
    assert wake_lock_holders() == 0


def test_await_writers_passes_over_held_rows_until_their_eta(lock_listener: Listener) -> None:
    """A row held until a later ETA is not claimable; one whose ETA passed is."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version, retry_after) VALUES ('held', 'tests.add', '[]', '{}', '{}', 1,"
            " now() + interval '1 day')"
        )
    with writer_holding_the_lock():
        assert lock_listener.await_writers() is Outwait.TIMED_OUT
    with connection.cursor() as cursor:
        cursor.execute("UPDATE outbox_notify_message_v1 SET retry_after = now() - interval '1 s'")
    with writer_holding_the_lock():
        assert lock_listener.await_writers() is Outwait.CLAIMABLE
