"""A relay that stops responding while asleep cannot keep the wake lock (PostgreSQL 14+)."""

from __future__ import annotations

import itertools
import signal
import time
from typing import Any

import psycopg
import pytest
from django.db import connection

from outbox_notify.relay.config import CLAIM_APPLICATION_NAME, LISTEN_APPLICATION_NAME
from outbox_notify.relay.store import connection_kwargs
from tests.integration.test_relay import ready
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
