"""The relay's index keeper: the outbox's indexes shrink back by themselves after an old snapshot.

Each test bloats the real outbox table of the test database the way test_reindex.py does (rows
written and deleted while a REPEATABLE READ session holds them), then lets the keeper look.
"""

# ruff: noqa: S608 - the table name is a constant of this module

from __future__ import annotations

import io
import signal
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import structlog
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from psycopg import sql as pgsql

from outbox_notify import index_keeper, reindex, stats
from outbox_notify.index_keeper import IndexKeeper
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.runner import connection_kwargs
from tests.integration.test_reindex import (
    INDEX_BYTES,
    INSERT,
    INVALID,
    TABLE,
    autovacuum_off,
    bloat,
    churn,
    connect,
    vacuum_while_held,
    writing,
)
from tests.relay_support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def bloated() -> Iterator[psycopg.Connection]:
    """An outbox whose indexes grew behind a snapshot that has ended since, vacuumed."""
    with connect() as writer:
        bloat(writer, 40_000)
        yield writer


def keeper(refuse_above: int = index_keeper.REFUSE_ABOVE) -> IndexKeeper:
    return IndexKeeper(connection_kwargs("default"), min_bytes=0, refuse_above=refuse_above)


def test_rebuilds_bloated_indexes_while_writers_go_on(bloated: psycopg.Connection) -> None:
    """Indexes many times the table's size are rebuilt, concurrently: a writer keeps committing,
    every live row stays reachable, no invalid index is left; then the keeper is disarmed."""
    bloated.execute(INSERT, (100,))
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    with writing() as committed, keeper() as watcher, structlog.testing.capture_logs() as logs:
        assert watcher.check() == "rebuilt"
        assert watcher.check() == "fine"  # disarmed: it went through
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


def test_leaves_indexes_under_the_floor(bloated: psycopg.Connection) -> None:
    """Indexes under the floor (16 MiB) are left alone whatever their ratio to the table."""
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    assert grown < reindex.BLOAT_MIN_BYTES
    with IndexKeeper(connection_kwargs("default")) as by_default:
        assert by_default.check() == "fine"
    assert bloated.execute(INDEX_BYTES).fetchone()[0] == grown


def test_leaves_indexes_that_fit_their_table() -> None:
    """A table in its steady state (indexes about the size of the table) is left alone."""
    with connect() as writer:
        writer.execute(INSERT, (5000,))
        writer.execute(f"DELETE FROM {TABLE} WHERE id % 2 = 0")
        writer.execute(f"VACUUM {TABLE}")
        before = writer.execute(INDEX_BYTES).fetchone()[0]
        with keeper() as watcher:
            assert watcher.check() == "fine"
        assert writer.execute(INDEX_BYTES).fetchone()[0] == before


def test_waits_while_a_snapshot_still_holds_the_dead_rows() -> None:
    """A rebuild now would keep the dead rows: the keeper waits for the snapshot to end."""
    with connect() as writer, connect("tests.old-snapshot", autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM {TABLE}")
        churn(writer, 4000)
        vacuum_while_held(writer, 4000)
        before = writer.execute(INDEX_BYTES).fetchone()[0]
        with keeper(refuse_above=100) as watcher:
            assert watcher.check() == "held"
        assert writer.execute(INDEX_BYTES).fetchone()[0] == before


def test_dead_rows_autovacuum_has_not_reached_yet_do_not_hold_it_back() -> None:
    """A busy outbox deletes more rows than the threshold between two autovacuum rounds: with
    no snapshot holding them, the keeper is armed but does not wait for them (a rebuild would
    leave them out). Its look is over once it found the indexes fit their table."""
    with connect() as writer, autovacuum_off(writer):
        writer.execute(f"VACUUM {TABLE}")
        before = stats.vacuum_horizon(writer.cursor())
        churn(writer, 4000)
        wait_for(lambda: stats.vacuum_horizon(writer.cursor()).dead_rows >= before.dead_rows + 4000)
        after = stats.vacuum_horizon(writer.cursor())
        assert after.dead_rows_held <= before.dead_rows_held + 100, (before, after)
        with keeper(refuse_above=before.dead_rows_held + 1000) as watcher:
            watcher.armed = False
            assert watcher.check() == "fine"
            assert watcher.armed


def test_rebuilds_only_after_dead_rows_piled_up(bloated: psycopg.Connection) -> None:
    """Disarmed (it rebuilt before, or the queue merely drained), the keeper leaves bloated
    indexes alone until a look finds more dead rows than its threshold; then it rebuilds once
    they are gone."""
    with keeper(refuse_above=10**9) as watcher:
        watcher.armed = False
        assert watcher.check() == "fine"
        watcher.refuse_above = 1000
        with connect("tests.old-snapshot", autocommit=False) as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute(f"SELECT count(*) FROM {TABLE}")
            churn(bloated, 4000)
            vacuum_while_held(bloated, 4000)
            assert watcher.check() == "held"
        assert watcher.armed
        bloated.execute(f"VACUUM {TABLE}")
        assert watcher.check() == "rebuilt"
        assert not watcher.armed


def test_without_a_session_of_its_own_it_does_not_look(bloated: psycopg.Connection) -> None:
    """Behind a transaction pooler (the relay fell back to polling) the keeper's session
    settings and advisory lock would go to other clients: it does nothing."""
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    with IndexKeeper(connection_kwargs("default"), session=lambda: False, min_bytes=0) as idle:
        assert idle.check() == "pooled"
    assert bloated.execute(INDEX_BYTES).fetchone()[0] == grown


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


def test_one_rebuild_at_a_time(bloated: psycopg.Connection) -> None:
    """Another relay's keeper, or outbox_reindex, holding the lock: the keeper leaves the
    rebuild to it, and outbox_reindex refuses while a keeper rebuilds."""
    with connect() as other:
        other.execute("SELECT pg_advisory_lock(1869968482, 2)")
        with keeper() as watcher:
            assert watcher.check() == "busy"
        with pytest.raises(CommandError, match="another rebuild of the outbox's indexes"):
            call_command("outbox_reindex", "--min-size", "0", stdout=io.StringIO())


def test_a_stop_cancels_a_rebuild_and_the_next_look_cleans_up(bloated: psycopg.Connection) -> None:
    """A relay stopping mid-rebuild cancels it (the rebuild waits on a long transaction here);
    the invalid copy it leaves is dropped and the indexes rebuilt by the next keeper."""
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    with (
        connect("tests.long-writer", autocommit=False) as long_writer,
        IndexKeeper(connection_kwargs("default"), interval=0.1, min_bytes=0) as watcher,
    ):
        long_writer.execute(INSERT, (1,))  # a transaction with an xid, left open
        watcher.start()
        wait_for(lambda: _reindexing(bloated), timeout=30)
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < index_keeper.STOP_WAIT + 1
        assert watcher.thread is not None
        assert not watcher.thread.is_alive()
        assert not _reindexing(bloated)
    assert bloated.execute(INVALID).fetchone()[0] >= 1
    with keeper() as again:
        assert again.check() == "rebuilt"
    assert bloated.execute(INVALID).fetchone() == (0,)
    assert bloated.execute(INDEX_BYTES).fetchone()[0] < grown / 4


def test_an_attempt_that_gives_up_is_tried_again(
    bloated: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild that waits too long for a long transaction gives up and stays armed: MIN_GAP
    later the keeper tries again; the invalid copy it left is dropped even by a keeper that
    is not armed."""
    monkeypatch.setattr(index_keeper, "LOCK_WAIT", 1.0)
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    with keeper() as watcher, structlog.testing.capture_logs() as logs:
        with connect("tests.long-writer", autocommit=False) as long_writer:
            long_writer.execute(INSERT, (1,))  # a transaction with an xid, left open
            assert watcher.check() == "rebuilt"
            assert watcher.armed
            assert watcher.check() == "waiting"
        assert bloated.execute(INVALID).fetchone()[0] >= 1
        watcher.next_try = 0.0
        watcher.armed = False
        assert watcher.check() == "rebuilt"
    gave_up = [e["gave_up"] for e in logs if e["event"] == "outbox.reindex_done"]
    assert gave_up[0], logs
    assert gave_up[1] is None, logs
    assert bloated.execute(INVALID).fetchone() == (0,)
    assert bloated.execute(INDEX_BYTES).fetchone()[0] < grown / 4


def _reindexing(conn: psycopg.Connection) -> bool:
    found = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'active'"
        " AND query LIKE '%%REINDEX INDEX CONCURRENTLY%%'",
        (index_keeper.APPLICATION_NAME,),
    ).fetchone()
    return bool(found and found[0])


BIG_ROWS = 160_000  # enough churn for the indexes to pass the keeper's 16 MiB floor


def test_outbox_listen_rebuilds_by_itself(start_relay: Any, relay_env: dict[str, Any]) -> None:
    """The real relay: `manage.py outbox_listen` gives the space back on its own, at its first
    look a minute after it starts, while it goes on relaying."""
    with connect() as writer:
        bloat(writer, BIG_ROWS)
        grown = writer.execute(INDEX_BYTES).fetchone()[0]
        assert grown > reindex.BLOAT_MIN_BYTES
        relay = start_relay("--sweep-interval", "1")
        deadline = index_keeper.CHECK_INTERVAL + 60
        wait_for(
            lambda: writer.execute(INDEX_BYTES).fetchone()[0] < grown / 4,
            timeout=deadline,
            context=relay.output,
        )
        relay.signal(signal.SIGTERM)
        assert relay.wait() == 0
    assert "outbox.reindex_done" in relay.output()


def test_the_relay_runs_it_only_where_it_has_a_session() -> None:
    """runner.index_keeper: off with --poll-only, with a LISTEN DSN (the alias goes through a
    transaction pooler then) and with OUTBOX_NOTIFY_AUTO_REINDEX = False; otherwise it looks
    only while the relay is not polling, and stops with the relay."""
    from outbox_notify.relay import runner

    listening = SimpleNamespace(config=RelayConfig(), connected=True, polling=False)
    with runner.index_keeper(listening) as running:  # type: ignore[arg-type]
        assert running is not None
        assert running.thread is not None
        assert running.thread.is_alive()
        listening.connected = False  # before the LISTEN probe ran, or while reconnecting
        assert running.check() == "pooled"
        listening.connected, listening.polling = True, True
        assert running.check() == "pooled"
    assert not running.thread.is_alive()
    polling_only = SimpleNamespace(config=RelayConfig(poll_only=True), polling=True)
    with runner.index_keeper(polling_only) as off:  # type: ignore[arg-type]
        assert off is None
    with (
        override_settings(OUTBOX_NOTIFY_LISTEN_DSN="postgresql://elsewhere/db"),
        runner.index_keeper(listening) as off,  # type: ignore[arg-type]
    ):
        assert off is None
    with (
        override_settings(OUTBOX_NOTIFY_AUTO_REINDEX=False),
        runner.index_keeper(listening) as off,  # type: ignore[arg-type]
    ):
        assert off is None
