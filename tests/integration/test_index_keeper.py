"""The relay's index keeper: the outbox's indexes shrink back by themselves after an old snapshot.

Each test bloats the real outbox table of the test database the way test_reindex.py does (rows
written and deleted while a REPEATABLE READ session holds them), then lets the keeper look.
"""

# ruff: noqa: S608 - the table name is a constant of this module

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import structlog
from django.test import override_settings
from psycopg import sql as pgsql

from outbox_notify import reindex, stats
from outbox_notify.relay import index_keeper
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.index_keeper import IndexKeeper
from outbox_notify.relay.runner import connection_kwargs
from tests.integration.test_reindex import INDEX_BYTES, INSERT, INVALID, TABLE, churn, connect
from tests.relay_support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 40_000


@pytest.fixture
def bloated() -> Iterator[psycopg.Connection]:
    """An outbox whose indexes grew behind a snapshot that has ended since, vacuumed (its
    table truncated back, as autovacuum's second round does)."""
    with connect() as writer:
        with connect("tests.old-snapshot", autocommit=False) as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute(f"SELECT count(*) FROM {TABLE}")
            churn(writer, ROWS)
        writer.execute(f"VACUUM {TABLE}")
        yield writer


def keeper(refuse_above: int = index_keeper.REFUSE_ABOVE) -> IndexKeeper:
    return IndexKeeper(connection_kwargs("default"), min_bytes=0, refuse_above=refuse_above)


def test_rebuilds_bloated_indexes_while_writers_go_on(bloated: psycopg.Connection) -> None:
    """Indexes many times the table's size are rebuilt, concurrently: a writer keeps committing,
    every live row stays reachable, no invalid index is left; then the keeper waits MIN_GAP."""
    bloated.execute(INSERT, (100,))
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    stop, committed = threading.Event(), []

    def write() -> None:
        with connect() as conn:
            while not stop.is_set():
                conn.execute(INSERT, (1,))
                committed.append(1)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with keeper() as watcher, structlog.testing.capture_logs() as logs:
            assert watcher.check() == "rebuilt"
            assert watcher.check() == "waiting"
    finally:
        stop.set()
        writer.join()
    rebuilt = bloated.execute(INDEX_BYTES).fetchone()[0]
    assert rebuilt < grown / 4, (grown, rebuilt)
    assert committed
    bloated.execute("SET enable_seqscan = off")
    live = 100 + len(committed)
    assert bloated.execute(f"SELECT count(*) FROM {TABLE} WHERE id > 0").fetchone() == (live,)
    assert bloated.execute(INVALID).fetchone() == (0,)
    done = [e for e in logs if e["event"] == "outbox.reindex_done"]
    assert len(done) == 1, logs
    assert done[0]["before_bytes"] > done[0]["after_bytes"], logs


def test_leaves_indexes_that_fit_their_table() -> None:
    """A table in its steady state (indexes about the size of the table) is left alone, and the
    default floor leaves small indexes alone whatever their ratio."""
    with connect() as writer:
        writer.execute(INSERT, (5000,))
        writer.execute(f"DELETE FROM {TABLE} WHERE id % 2 = 0")
        writer.execute(f"VACUUM {TABLE}")
        before = writer.execute(INDEX_BYTES).fetchone()[0]
        with keeper() as watcher, IndexKeeper(connection_kwargs("default")) as by_default:
            assert watcher.check() == "fine"
            assert by_default.check() == "fine"
        assert writer.execute(INDEX_BYTES).fetchone()[0] == before


def test_waits_while_a_snapshot_still_holds_the_dead_rows() -> None:
    """A rebuild now would keep the dead rows: the keeper waits for the snapshot to end."""
    with connect() as writer, connect("tests.old-snapshot", autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM {TABLE}")
        churn(writer, 4000)
        # The dead rows reach the statistics when the writer's transactions report them.
        wait_for(lambda: stats.vacuum_horizon(writer.cursor())[0] >= 4000)
        before = writer.execute(INDEX_BYTES).fetchone()[0]
        with keeper(refuse_above=100) as watcher:
            assert watcher.check() == "held"
        assert writer.execute(INDEX_BYTES).fetchone()[0] == before


def test_a_role_that_does_not_own_the_indexes_warns(bloated: psycopg.Connection) -> None:
    """The relay's own role (sql/relay_role.sql) cannot rebuild: it says what to run instead,
    once per WARNING_INTERVAL."""
    role = f"keeper_{uuid.uuid4().hex[:12]}"
    bloated.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    try:
        params = {**connection_kwargs("default"), "user": role}
        params.pop("password", None)
        grown = bloated.execute(INDEX_BYTES).fetchone()[0]
        with IndexKeeper(params, min_bytes=0) as watcher, structlog.testing.capture_logs() as logs:
            assert watcher.check() == "not owned"
            assert watcher.check() == "not owned"
        warned = [e for e in logs if e["event"] == "outbox.reindex_needed"]
        assert len(warned) == 1, logs
        assert "outbox_reindex" in warned[0]["hint"]
        assert bloated.execute(INDEX_BYTES).fetchone()[0] == grown
    finally:
        bloated.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))


def test_one_keeper_rebuilds_at_a_time(bloated: psycopg.Connection) -> None:
    """Another relay's keeper holding the lock: this one leaves the rebuild to it."""
    with connect() as other:
        other.execute("SELECT pg_advisory_lock(1869968482, 2)")
        with keeper() as watcher:
            assert watcher.check() == "busy"


def test_the_relay_runs_it_on_a_timer_and_stops_it(
    bloated: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """outbox_listen's keeper (runner.index_keeper) rebuilds on its own timer, and stops with
    the relay; OUTBOX_NOTIFY_AUTO_REINDEX = False turns it off."""
    from outbox_notify.relay import runner

    # The timer and the floor, shortened for the test (60 s and 16 MiB in a relay).
    monkeypatch.setattr(index_keeper, "CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(reindex, "BLOAT_MIN_BYTES", 0)
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    config = RelayConfig()
    with runner.index_keeper(config) as running:
        assert running is not None
        wait_for(lambda: bloated.execute(INDEX_BYTES).fetchone()[0] < grown / 4, timeout=30)
        started = time.monotonic()
    assert running.thread is not None
    assert not running.thread.is_alive()
    assert time.monotonic() - started < 5
    with override_settings(OUTBOX_NOTIFY_AUTO_REINDEX=False), runner.index_keeper(config) as off:
        assert off is None
