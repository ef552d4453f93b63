"""The relay's LISTEN probe against a real server: a notification must travel between sessions."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from outbox_notify.relay.config import PROBE_CHANNEL
from outbox_notify.relay.listener import Listener
from outbox_notify.relay.runner import connection_kwargs

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: notifications are delivered only when the sending session commits.


@pytest.fixture
def listener() -> Iterator[Listener]:
    probe = Listener(connection_kwargs("default"), lock_wait=0.05, wake_fd=None)
    probe.connect()
    yield probe
    probe.close()


def _notifier(dbname: str | None = None) -> psycopg.Connection:
    params = connection_kwargs("default")
    if dbname is not None:
        params["dbname"] = dbname
    return psycopg.connect(**params, autocommit=True)


def test_probe_finds_its_notification_behind_others(listener: Listener) -> None:
    """Another relay's probe arriving first, on its own, does not fail ours."""
    sent: list[threading.Timer] = []
    with _notifier() as other, _notifier() as late:

        def send(payload: str) -> None:
            other.execute("SELECT pg_notify(%s, 'another relay')", (PROBE_CHANNEL,))
            # Ours comes 0.2 s later, so the listener receives the other one alone first.
            timer = threading.Timer(
                0.2, late.execute, ("SELECT pg_notify(%s, %s)", (PROBE_CHANNEL, payload))
            )
            timer.start()
            sent.append(timer)

        assert listener.probe(send)
        sent[0].join()


def test_probe_fails_when_the_notification_goes_to_another_database(listener: Listener) -> None:
    """A LISTEN DSN that reaches another database than the claims is caught by the probe."""
    with _notifier("postgres") as elsewhere:
        assert not listener.probe(
            lambda payload: elsewhere.execute("SELECT pg_notify(%s, %s)", (PROBE_CHANNEL, payload))
        )


def test_probe_leaves_no_session_state_behind(listener: Listener) -> None:
    """Until listen() the connection LISTENs on nothing and keeps its lock_timeout."""
    conn = listener.conn
    assert conn is not None
    before = conn.execute("SHOW lock_timeout").fetchone()
    with _notifier() as other:
        assert listener.probe(
            lambda payload: other.execute("SELECT pg_notify(%s, %s)", (PROBE_CHANNEL, payload))
        )
    assert conn.execute("SELECT pg_listening_channels()").fetchall() == []
    assert conn.execute("SHOW lock_timeout").fetchone() == before
    listener.listen()
    assert conn.execute("SELECT pg_listening_channels()").fetchall() == [("outbox_notify_v1",)]
    assert conn.execute("SHOW lock_timeout").fetchone() == ("50ms",)
