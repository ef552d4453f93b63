"""The wake-up trigger against a real PostgreSQL: when it notifies, and when it stays quiet."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox_notify.relay.runner import connection_kwargs

CHANNEL = "outbox_notify_v1"
LOCK = (1869968482, 1)
INSERT = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, schema_version)"
    " VALUES (%s, 't', '[]', '{}', '{}', 1)"
)

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: notifications are delivered only on commit, which a test wrapped in a
# rolled-back transaction never reaches.


def _connect() -> psycopg.Connection:
    params = connection_kwargs("default")
    return psycopg.connect(**params, autocommit=True)


@pytest.fixture
def sleeping_relay() -> Iterator[psycopg.Connection]:
    """A connection that LISTENs and holds the relay's exclusive lock, as a sleeping relay does."""
    conn = _connect()
    conn.execute(f"LISTEN {CHANNEL}")
    conn.execute("SELECT pg_advisory_lock(%s, %s)", LOCK)
    yield conn
    conn.close()


def _notifications(conn: psycopg.Connection, wait: float = 0.5) -> list[psycopg.Notify]:
    return list(conn.notifies(timeout=wait))


def test_notifies_after_commit_once_per_transaction(sleeping_relay: psycopg.Connection) -> None:
    """Many rows in one committed transaction give exactly one notification."""
    with _connect() as writer, writer.transaction():
        for n in range(5):
            writer.execute(INSERT, [f"id-{n}"])
        writer.execute(INSERT, ["id-last"])
        assert _notifications(sleeping_relay, wait=0.2) == []
    received = _notifications(sleeping_relay)
    assert [(n.channel, n.payload) for n in received] == [(CHANNEL, "")]


def test_rollback_never_notifies(sleeping_relay: psycopg.Connection) -> None:
    """A rolled-back insert sends nothing."""
    with _connect() as writer:
        writer.execute("BEGIN")
        writer.execute(INSERT, ["gone"])
        writer.execute("ROLLBACK")
    assert _notifications(sleeping_relay) == []


def test_no_notify_while_no_relay_sleeps() -> None:
    """With no relay holding the lock, inserts commit without NOTIFY (the cheap path)."""
    listener = _connect()
    listener.execute(f"LISTEN {CHANNEL}")
    try:
        with _connect() as writer:
            writer.execute(INSERT, ["quiet"])
        assert _notifications(listener) == []
    finally:
        listener.close()


def _wait_until_queued(conn: psycopg.Connection) -> None:
    for _ in range(200):
        waiting = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objid = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            LOCK,
        ).fetchone()
        if waiting and waiting[0]:
            return
        time.sleep(0.01)
    raise AssertionError("the relay never queued for the lock")


def test_a_relay_queued_for_the_lock_is_notified_by_later_writers() -> None:
    """While a writer holds the shared lock, a relay waits; writers arriving meanwhile notify."""
    early = _connect()
    relay = _connect()
    relay.execute(f"LISTEN {CHANNEL}")
    try:
        early.execute("BEGIN")
        early.execute(INSERT, ["early"])  # takes the shared lock, no notify
        relay.execute("SET lock_timeout = '2s'")
        # The relay queues for the exclusive lock without blocking this test: send only.
        relay.pgconn.send_query(b"SELECT pg_advisory_lock(1869968482, 1)")
        _wait_until_queued(early)
        with _connect() as late:
            late.execute(INSERT, ["late"])  # the try-lock fails behind the queued relay: notify
        early.execute("COMMIT")
        while relay.pgconn.get_result() is not None:
            pass
        # Reading the lock's result through libpq also read the notification into libpq's
        # own queue, where psycopg's notifies() generator would not look again.
        channels = []
        while (notify := relay.pgconn.notifies()) is not None:
            channels.append(notify.relname.decode())
        assert channels == [CHANNEL]
    finally:
        early.close()
        relay.close()
