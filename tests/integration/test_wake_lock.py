"""A relay that stops responding while asleep cannot keep the wake lock (PostgreSQL 14+)."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from django.db import connection

from tests.integration.test_relay import ready
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay is another process; the lock and its release are server state.


def wake_lock_holders() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1869968482"
            " AND objid = 1 AND objsubid = 2 AND granted AND mode = 'ExclusiveLock'"
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


def _transactions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def test_an_idle_relay_makes_one_query_per_sweep_interval(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """Asleep with nothing to do, a relay keeps its lock and only peeks once per sweep interval."""
    relay = start_relay("--sweep-interval", "0.5")
    ready(relay)
    wait_for(lambda: wake_lock_holders() == 1, what="the relay asleep", context=relay.output)
    time.sleep(1.5)  # the server reports backend statistics at most once a second
    before = _transactions()
    time.sleep(6.0)
    used = _transactions() - before
    # 12 sweep intervals: 12 peeks, plus this test's own statements and reporting jitter.
    assert used <= 12 + 6, f"{used} transactions in 6 s"
