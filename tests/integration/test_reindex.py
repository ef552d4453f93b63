"""`manage.py outbox_reindex`: the outbox's indexes give back what an old snapshot made them grow.

Each test bloats the real outbox table of the test database: rows inserted and deleted by other
sessions while a REPEATABLE READ session keeps them from being vacuumed.
"""

# ruff: noqa: S608 - the table name is a constant of this module

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from outbox_notify import stats
from outbox_notify.relay.runner import connection_kwargs
from tests.relay_support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = "outbox_notify_message_v1"
INSERT = (
    f"INSERT INTO {TABLE} (task_id, task_name, args, kwargs, options, schema_version)"
    " SELECT 'bloat-' || gen_random_uuid(), 'tests.add', '[]', '{}', '{}', 4"
    " FROM generate_series(1, %s)"
)
INDEX_BYTES = f"SELECT pg_indexes_size('{TABLE}')"
HEAP_BYTES = f"SELECT pg_relation_size('{TABLE}')"
TRUNCATED_BYTES = 64 * 1024  # an emptied outbox, vacuumed and truncated: a page or two
TRUNCATE_WAIT = 30.0  # seconds bloat() vacuums again while another session holds the rows
# Sessions of this database whose snapshot or locks can keep VACUUM from freeing or truncating.
HOLDERS = (
    "SELECT pid, application_name, state, backend_xmin, xact_start, left(query, 80)"
    " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND (backend_xmin IS NOT NULL OR xact_start IS NOT NULL)"
)
INVALID = f"SELECT count(*) FROM pg_index WHERE indrelid = '{TABLE}'::regclass AND NOT indisvalid"
ROWS = 40_000


def connect(application_name: str = "tests", autocommit: bool = True) -> psycopg.Connection:
    params = connection_kwargs("default")
    params["application_name"] = application_name
    return psycopg.connect(**params, autocommit=autocommit)


def churn(conn: psycopg.Connection, rows: int) -> None:
    """Rows written and published (deleted) the way the outbox does, a batch at a time."""
    for _ in range(rows // 2000):
        conn.execute(INSERT, (2000,))
        conn.execute(f"DELETE FROM {TABLE} WHERE task_id LIKE 'bloat-%%'")


def vacuum_while_held(writer: psycopg.Connection, rows: int) -> None:
    """With a snapshot holding the `rows` dead rows just churned, VACUUM: it has to leave
    them, and the statistics then count them as held back (dead_rows_held)."""
    # The dead rows reach the statistics when the writer's transactions report them.
    wait_for(lambda: stats.vacuum_horizon(writer.cursor()).dead_rows >= rows)
    writer.execute(f"VACUUM {TABLE}")
    wait_for(lambda: stats.vacuum_horizon(writer.cursor()).dead_rows_held >= rows)


@contextlib.contextmanager
def autovacuum_off(writer: psycopg.Connection) -> Iterator[None]:
    """No autovacuum round on the outbox table in the block (it vacuums at every thousand
    dead rows): a test of rows vacuum has not reached yet must not see one removed."""
    writer.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = off)")
    try:
        yield
    finally:
        writer.execute(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")


def bloat(writer: psycopg.Connection, rows: int) -> None:
    """Churn `rows` behind a snapshot that ends afterwards, then vacuum: the table is truncated
    back, as autovacuum's second round does, and the indexes keep the size they reached."""
    with connect("tests.old-snapshot", autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM {TABLE}")
        churn(writer, rows)
    # VACUUM frees the dead rows and truncates the emptied tail only if no other session of the
    # database still holds a snapshot from before the deletes, and it gets the table's lock for
    # a moment: a session an earlier test left may still be ending. Vacuum again until the
    # table is back to a few pages, as autovacuum's next round would; name the holders if not.
    deadline = time.monotonic() + TRUNCATE_WAIT
    while True:
        writer.execute(f"VACUUM {TABLE}")
        heap = writer.execute(HEAP_BYTES).fetchone()[0]
        if heap <= TRUNCATED_BYTES:
            return
        if time.monotonic() > deadline:
            holders = writer.execute(HOLDERS).fetchall()
            raise AssertionError(f"{TABLE} stays at {heap} bytes after VACUUM; holders: {holders}")
        time.sleep(0.5)


@contextlib.contextmanager
def writing() -> Iterator[list[int]]:
    """A writer committing one row at a time in a thread while the block runs; its commits."""
    stop, committed = threading.Event(), []

    def write() -> None:
        with connect() as conn:
            while not stop.is_set():
                conn.execute(INSERT, (1,))
                committed.append(1)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield committed
    finally:
        stop.set()
        writer.join()


@pytest.fixture
def bloated() -> Iterator[psycopg.Connection]:
    """An outbox whose indexes grew behind a snapshot that has ended since, vacuumed."""
    with connect() as writer:
        bloat(writer, ROWS)
        yield writer


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command("outbox_reindex", *args, stdout=out)
    return out.getvalue()


def test_rebuilds_the_indexes_to_their_size_without_dead_rows(bloated: psycopg.Connection) -> None:
    """After the snapshot ends the indexes keep their size; the rebuild gives it back while a
    writer goes on committing, and every live row stays reachable through them."""
    bloated.execute(INSERT, (100,))
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    with writing() as committed:
        printed = _run("--min-size", "0")
    rebuilt = bloated.execute(INDEX_BYTES).fetchone()[0]
    assert rebuilt < grown / 4, (grown, rebuilt, printed)
    assert "outbox indexes:" in printed
    assert committed  # writers were never blocked for the whole rebuild
    live = 100 + len(committed)
    bloated.execute("SET enable_seqscan = off")
    assert bloated.execute(f"SELECT count(*) FROM {TABLE} WHERE id > 0").fetchone() == (live,)
    assert bloated.execute(INVALID).fetchone() == (0,)


def test_refuses_while_a_snapshot_holds_dead_rows() -> None:
    """With the snapshot still open, the command names it and changes nothing."""
    with connect() as writer, connect("tests.old-snapshot", autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM {TABLE}")
        churn(writer, 4000)
        vacuum_while_held(writer, 4000)
        before = writer.execute(INDEX_BYTES).fetchone()[0]
        with pytest.raises(CommandError, match=r"tests\.old-snapshot") as caught:
            _run("--min-size", "0", "--refuse-above", "100")
        assert "end that transaction first" in str(caught.value)
        assert writer.execute(INDEX_BYTES).fetchone()[0] == before


def test_dead_rows_vacuum_has_not_reached_yet_are_no_reason_to_refuse() -> None:
    """Dead rows only waiting for autovacuum's next round (more than the threshold on a busy
    outbox), with a younger snapshot open beside them (a relay's claim, often): not refused."""
    with connect() as writer, autovacuum_off(writer):
        writer.execute(f"VACUUM {TABLE}")
        before = stats.vacuum_horizon(writer.cursor())
        churn(writer, 4000)
        wait_for(lambda: stats.vacuum_horizon(writer.cursor()).dead_rows >= before.dead_rows + 4000)
        with connect("tests.young-snapshot", autocommit=False) as young:
            young.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            young.execute(f"SELECT count(*) FROM {TABLE}")
            assert stats.vacuum_horizon(writer.cursor()).holder is not None
            threshold = str(before.dead_rows_held + 1000)
            printed = _run("--dry-run", "--min-size", "0", "--refuse-above", threshold)
    assert f"{TABLE}_pkey" in printed


def test_dry_run_lists_and_changes_nothing(bloated: psycopg.Connection) -> None:
    grown = bloated.execute(INDEX_BYTES).fetchone()[0]
    printed = _run("--dry-run", "--min-size", "0")
    assert f"{TABLE}_pkey" in printed
    assert "rebuild" in printed
    assert bloated.execute(INDEX_BYTES).fetchone()[0] == grown


def test_a_rebuild_that_gives_up_is_cleaned_up_by_the_next_run(
    bloated: psycopg.Connection,
) -> None:
    """A rebuild that waits longer than --lock-wait for a running transaction gives up and says
    so; the invalid copy it leaves (dropping it would wait as long) is dropped by the next run,
    which then rebuilds."""
    with connect("tests.long-writer", autocommit=False) as long_writer:
        long_writer.execute(INSERT, (1,))  # a transaction with an xid, left open
        with pytest.raises(CommandError, match="within --lock-wait"):
            _run("--min-size", "0", "--lock-wait", "0.5")
        assert bloated.execute(INVALID).fetchone()[0] >= 1
        with pytest.raises(CommandError, match=r"could not drop .*_ccnew"):
            _run("--min-size", "0", "--lock-wait", "0.5")
    printed = _run("--min-size", "0")
    assert "_ccnew  dropped" in printed
    assert "outbox indexes:" in printed
    assert bloated.execute(INVALID).fetchone() == (0,)
