"""Claims read from the relay's frontier: no walk over published rows, and no row left behind.

Every test drives real claims (ClaimStore, the relay's own claim connection and SQL) against a
real PostgreSQL, with writers and other relays on connections of their own, so row locks,
snapshots and transactions that commit late behave as they do in production.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from structlog.testing import capture_logs

from outbox_notify import sql, stats
from outbox_notify.relay import store as store_module
from outbox_notify.relay.frontier import LAST_ID, Frontier
from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.store import ClaimStore, Outcome, Retry
from outbox_notify.serialization import SCHEMA_VERSION

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: claims, writers and the snapshot holder are separate sessions that see
# only committed rows.

INSERT = (
    "INSERT INTO outbox_notify_message_v1"
    " (task_id, task_name, args, kwargs, options, schema_version, retry_after)"
    " SELECT 'row-' || n, 'tests.add', '[1, 2]', '{}', '{}', %(version)s, %(retry_after)s"
    " FROM generate_series(1, %(count)s) AS n"
    " RETURNING id"
)


def _connect(autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(**connection_kwargs("default"), autocommit=autocommit)


def _insert(
    conn: psycopg.Connection[Any], count: int = 1, retry_after: dt.datetime | None = None
) -> list[int]:
    params = {"count": count, "retry_after": retry_after, "version": SCHEMA_VERSION}
    return [row[0] for row in conn.execute(INSERT, params).fetchall()]


@pytest.fixture
def stores() -> Iterator[list[ClaimStore]]:
    """Claim stores (one relay's claim connection each); closed after the test.

    No frontier saved by an earlier test's relays: Django's flush empties the model tables only.
    """
    with _connect() as conn:
        conn.execute("DELETE FROM outbox_notify_frontier_v1")
    made: list[ClaimStore] = []
    yield made
    for store in made:
        store.close()


@pytest.fixture
def new_store(stores: list[ClaimStore]) -> Any:
    def make(frontier: Frontier | None = None) -> ClaimStore:
        store = ClaimStore(connection_kwargs("default"), stale_timeout=30, frontier=frontier)
        store.connect()
        stores.append(store)
        return store

    return make


def _publish_all(store: ClaimStore, limit: int = 100) -> list[int]:
    """Claim and delete batches until a claim comes back empty; the ids published."""
    published: list[int] = []
    while True:
        with store.claim(limit) as claim:
            ids = [row.id for row in claim.rows]
            claim.finish(Outcome(published=ids))
        published += ids
        if not ids:
            return published


@pytest.fixture
def old_snapshot() -> Iterator[psycopg.Connection[Any]]:
    """A session left inside a REPEATABLE READ transaction: nothing deleted since is vacuumable."""
    conn = _connect(autocommit=False)
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT 1")
    yield conn
    conn.close()


def _claim_buffers(frontier: Frontier, limit: int) -> int:
    """Shared buffers one claim statement touches, from this frontier (rolled back)."""
    params = {**frontier.params(), "limit": limit, "max_version": SCHEMA_VERSION}
    with _connect(autocommit=False) as conn:
        conn.execute(sql.queries()["set_claim_timeout"], {"timeout_ms": "30000"})
        (plan,) = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.queries()["claim_batch"], params
        ).fetchone() or ("[]",)
        conn.rollback()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_a_claim_does_not_read_the_rows_published_before_it(
    new_store: Any, old_snapshot: psycopg.Connection[Any]
) -> None:
    """With an old snapshot holding 20,000 deleted rows in place, a claim reads only new rows."""
    relay = new_store()
    with _connect() as writer:
        for _ in range(40):
            _insert(writer, 500)
            _publish_all(relay, limit=500)
        _insert(writer, 10)
    from_frontier = _claim_buffers(relay.frontier, limit=100)
    from_start = _claim_buffers(Frontier(), limit=100)  # a relay that knows nothing yet
    # The relay's claim reads a few index and heap pages; one from the start reads the pages
    # of all 20,000 dead rows (the old snapshot keeps vacuum from removing them).
    assert from_start > 150, from_start
    assert from_frontier * 10 < from_start, (from_frontier, from_start)
    assert len(_publish_all(relay)) == 10


def test_a_full_claim_reads_about_the_rows_it_claims_not_the_backlog_behind_them(
    new_store: Any,
) -> None:
    """Inside a 50,000-row backlog, a full claim of 100 reads about 100 rows' pages, not the
    rest of the backlog (the rows left behind are looked for only up to the last row taken)."""
    relay = new_store()
    with _connect() as writer:
        _insert(writer, 50_000)
    with relay.claim(100) as claim:  # moves the frontier into the backlog
        claim.finish(Outcome(published=[row.id for row in claim.rows]))
    mid_backlog = _claim_buffers(relay.frontier, limit=100)
    # Before the bound was an index condition, this claim read all 49,900 rows left (over
    # 950 buffers here); now about 300.
    assert mid_backlog < 600, mid_backlog


def test_a_full_claim_reads_as_much_with_50000_rows_ahead_as_with_500(new_store: Any) -> None:
    """The rows a full claim left behind are looked for between the frontier and its last row
    taken. Bounded by two row comparisons, that index scan did not stop at the last row: it
    read the index to its end, every row still ahead of the claim, at every claim of a drain."""
    relay = new_store()
    with _connect() as writer:
        _insert(writer, 50_000)  # one transaction: one txid for the whole backlog
    with relay.claim(100) as claim:
        claim.finish(Outcome(published=[row.id for row in claim.rows]))
    far = _claim_buffers(relay.frontier, limit=100)
    for _ in range(98):  # 49,000 more published: 900 rows left ahead
        with relay.claim(500) as claim:
            claim.finish(Outcome(published=[row.id for row in claim.rows]))
    near = _claim_buffers(relay.frontier, limit=100)
    # Before: far read about 170 index pages more than near (the 49,000 rows' entries).
    assert far < near * 1.3 + 10, (far, near)


def test_a_full_claim_of_a_late_transaction_reads_about_the_rows_it_claims(
    new_store: Any,
) -> None:
    """A 50,000-row transaction still open at a claim is read by txid once it commits: a full
    claim of its rows reads about 100 rows' pages, not the rows of it left for later claims."""
    relay = new_store()
    with _connect(autocommit=False) as slow, _connect() as writer:
        _insert(slow, 50_000)
        _insert(writer, 1)  # ends after the slow transaction began: the claim sees it running
        assert len(_publish_all(relay)) == 1
        assert relay.frontier.late
        slow.commit()
    with relay.claim(100) as claim:
        assert len(claim.rows) == 100
        claim.finish(Outcome(published=[row.id for row in claim.rows]))
    inside = _claim_buffers(relay.frontier, limit=100)
    # The rows the late part passed used to be listed at every claim, whether or not the part
    # was read to its end: all 49,900 left (over 900 buffers here, and the CPU of reading
    # each row); now about 110.
    assert inside < 400, inside
    assert len(_publish_all(relay)) == 49_900


def test_rows_another_relay_published_are_read_at_most_once(
    new_store: Any, old_snapshot: psycopg.Connection[Any]
) -> None:
    """A relay that idled while another published 20,000 rows reads those dead rows once, then
    never again: a claim that reads to the end moves past every transaction it could see."""
    idle, busy = new_store(), new_store()
    with _connect() as writer:
        _publish_all(idle)
        for _ in range(40):
            _insert(writer, 500)
            _publish_all(busy, limit=500)
        _publish_all(idle)  # reads the dead rows once
        _insert(writer, 10)
    after = _claim_buffers(idle.frontier, limit=100)
    from_start = _claim_buffers(Frontier(), limit=100)
    assert from_start > 150, from_start
    assert after * 10 < from_start, (after, from_start)


def test_a_row_whose_transaction_commits_late_is_claimed_at_its_commit(new_store: Any) -> None:
    """A row written by a transaction still open while later rows are published is claimed at commit."""
    relay = new_store()
    with _connect(autocommit=False) as slow, _connect() as writer:
        late = _insert(slow, 3)  # an older txid and smaller ids than what follows
        for _ in range(3):
            _insert(writer, 5)
            assert len(_publish_all(relay)) == 5
        slow.commit()
        assert sorted(_publish_all(relay)) == late


def test_a_late_transaction_that_started_writing_after_the_frontier_moved_is_found(
    new_store: Any,
) -> None:
    """A transaction that took its id early but wrote its row late is still claimed at commit."""
    relay = new_store()
    with _connect(autocommit=False) as slow, _connect() as writer:
        slow.execute("CREATE TEMP TABLE other_work (n int)")
        slow.execute("INSERT INTO other_work VALUES (1)")  # its transaction id is taken now
        _insert(writer, 5)
        _publish_all(relay)
        late = _insert(slow, 2)
        _insert(writer, 5)
        _publish_all(relay)
        slow.commit()
        assert sorted(_publish_all(relay)) == late


def test_rows_another_relay_held_are_claimed_once_it_dies(new_store: Any) -> None:
    """A relay passes over rows another relay holds, and claims them when that relay's session ends."""
    first, second = new_store(), new_store()
    with _connect() as writer:
        ids = _insert(writer, 10)
        with first.claim(4) as held:
            assert [r.id for r in held.rows] == ids[:4]
            assert sorted(_publish_all(second)) == ids[4:]
            _insert(writer, 2)
            pid = first.conn.info.backend_pid if first.conn else 0
            writer.execute("SELECT pg_terminate_backend(%s)", [pid])
            time.sleep(0.2)
            assert sorted(_publish_all(second)) == [*ids[:4], *range(ids[-1] + 1, ids[-1] + 3)]


def test_rows_this_relay_released_untouched_are_claimed_again(new_store: Any) -> None:
    """A claim that ends without an outcome (an error, a stop) leaves its rows for the next claim."""
    relay = new_store()
    with _connect() as writer:
        ids = _insert(writer, 5)
        with relay.claim(10) as claim:
            assert [r.id for r in claim.rows] == ids
        with relay.claim(10) as claim:
            kept = [r.id for r in claim.rows[:2]]
            claim.finish(Outcome(published=[r.id for r in claim.rows[2:]]))
        assert sorted(_publish_all(relay)) == kept


def test_a_retry_falls_due_and_is_claimed_by_the_relay_that_scheduled_it(new_store: Any) -> None:
    """A row rescheduled by a relay's own claim comes back to that relay when it falls due."""
    relay = new_store()
    with _connect() as writer:
        (row,) = _insert(writer, 1)
        with relay.claim(10) as claim:
            claim.finish(Outcome(retry=[Retry(id=row, retries=1, delay=0.3, error="refused")]))
        _insert(writer, 3)
        assert row not in _publish_all(relay)
        time.sleep(0.4)
        assert _publish_all(relay) == [row]


def test_a_held_row_whose_transaction_commits_after_its_eta_is_claimed_at_commit(
    new_store: Any,
) -> None:
    """A held row made visible after its ETA passed (and the due frontier with it) is still claimed."""
    relay = new_store()
    with _connect(autocommit=False) as slow, _connect() as writer:
        eta = slow.execute("SELECT clock_timestamp() + interval '0.2 s'").fetchone()[0]  # type: ignore[index]
        (held,) = _insert(slow, 1, retry_after=eta)
        time.sleep(0.3)
        _insert(writer, 1, retry_after=eta)  # a due row that moves the due frontier past the ETA
        assert len(_publish_all(relay)) == 1
        slow.commit()
        assert _publish_all(relay) == [held]


def test_a_held_row_made_ready_by_hand_is_claimed(new_store: Any) -> None:
    """An operator's UPDATE (publish a held task now) makes the row claimable to every relay."""
    relay = new_store()
    with _connect() as writer:
        far = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        (held,) = _insert(writer, 1, retry_after=far)
        _insert(writer, 3)
        assert held not in _publish_all(relay)
        writer.execute(
            "UPDATE outbox_notify_message_v1 SET retry_after = NULL WHERE id = %s", [held]
        )
        assert _publish_all(relay) == [held]


def test_the_peek_sees_what_the_next_claim_would_take(new_store: Any) -> None:
    """The sleep decision reads the same frontier: nothing claimable after a drain, a late row after its commit."""
    relay = new_store()
    with _connect(autocommit=False) as slow, _connect() as writer:
        late = _insert(slow, 1)
        _insert(writer, 4)
        _publish_all(relay)
        assert relay.peek().claimable is False
        slow.commit()
        assert relay.peek().claimable is True
        assert _publish_all(relay) == late


def test_a_relay_starting_later_reads_from_the_frontier_saved_before(
    new_store: Any, old_snapshot: psycopg.Connection[Any]
) -> None:
    """A relay (or a sweep) that starts after another stopped does not walk what it published."""
    first = new_store()
    with _connect() as writer:
        for _ in range(20):
            _insert(writer, 500)
            _publish_all(first, limit=500)
        first.close()  # a clean stop saves the frontier
        _insert(writer, 10)
    later = new_store()
    from_saved = _claim_buffers(later.frontier, limit=100)
    from_start = _claim_buffers(Frontier(), limit=100)
    assert from_start > 100, from_start
    assert from_saved * 10 < from_start, (from_saved, from_start)
    assert len(_publish_all(later)) == 10


def test_rows_held_by_a_relay_that_dies_are_claimed_by_one_that_starts_from_its_save(
    new_store: Any,
) -> None:
    """A saved frontier counts the saving relay's open claims: its successor claims them again."""
    shared = Frontier()
    one, other = new_store(shared), new_store(shared)  # one relay, two claim connections
    one.next_save = time.monotonic() + 3600  # only the other connection's claims save
    with _connect() as writer:
        first = _insert(writer, 3)
        with one.claim(10) as held:  # held while the other connection claims and saves
            assert [r.id for r in held.rows] == first
            second = _insert(writer, 2)
            other.next_save = 0.0
            assert sorted(_publish_all(other)) == second  # its claims save the frontier
            pid = one.conn.info.backend_pid if one.conn else 0
            writer.execute("SELECT pg_terminate_backend(%s)", [pid])
            time.sleep(0.2)
            if one.conn is not None:  # the relay process died with it: nothing saved
                one.conn.close()
                one.conn = None
        if other.conn is not None:
            other.conn.close()
            other.conn = None
    successor = new_store(Frontier())
    assert successor.frontier.recheck >= set(first)
    assert sorted(_publish_all(successor)) == first


def test_a_frontier_saved_by_a_relay_of_an_older_schema_version_is_not_loaded(
    new_store: Any,
) -> None:
    """An older relay passed over rows of newer versions: a newer relay never starts from its save."""
    ahead = Frontier()
    ahead.ready = (2**40, 2**40)  # past every row
    with _connect() as conn:
        conn.execute(
            "INSERT INTO outbox_notify_frontier_v1 (max_version, state) VALUES (%s, %s)",
            [SCHEMA_VERSION - 1, json.dumps(ahead.state())],
        )
        ids = _insert(conn, 2)
    relay = new_store(Frontier())
    assert relay.frontier.ready == (0, 0)
    assert sorted(_publish_all(relay)) == ids


def _good_state() -> dict[str, Any]:
    state = Frontier().state()
    state["ready"] = ["5", 5]
    return state


def _spoilt(**changes: Any) -> dict[str, Any]:
    state = _good_state()
    for key, value in changes.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    return state


@pytest.mark.parametrize(
    "state",
    [
        _spoilt(ready=None),
        _spoilt(ready=["five", 5]),
        _spoilt(ready=["5"]),
        _spoilt(ready=["5", 2**63]),  # past a bigint: no claim could send it
        _spoilt(ready=["-1", 5]),
        _spoilt(due=["yesterday", 0]),
        _spoilt(due=["2026-11-27T12:00:00", 0]),  # no time zone
        _spoilt(scheduled=[None, 0]),
        _spoilt(late=["7", "x"]),
        _spoilt(late=[str(2**64)]),  # past an xid8
        _spoilt(recheck=[1, -2]),
        _spoilt(recheck=7),
        ["not", "an", "object"],
        [],
        "garbage",
        0,
        {"format": "1"},
        {"format": 2, "ready": ["5", 5]},
    ],
    ids=[
        "ready missing",
        "ready txid not a number",
        "ready without id",
        "ready id past a bigint",
        "ready txid negative",
        "due not a time",
        "due without time zone",
        "scheduled txid null",
        "late not a number",
        "late past an xid8",
        "recheck id negative",
        "recheck not a list",
        "not an object",
        "an empty list",
        "a string",
        "a number",
        "format not a number",
        "another format",
    ],
)
def test_a_frontier_saved_unreadable_is_a_start_from_the_beginning_not_a_relay_that_cannot_start(
    new_store: Any, state: Any
) -> None:
    """A saved frontier edited by hand, or damaged, must not keep every relay from starting:
    the relay warns and starts from the beginning of every index, which is always safe."""
    untouched = Frontier()
    untouched.load(_good_state())
    assert untouched.ready == (5, 5)
    with _connect() as conn:
        conn.execute(
            "INSERT INTO outbox_notify_frontier_v1 (max_version, state) VALUES (%s, %s)",
            [SCHEMA_VERSION, json.dumps(state)],
        )
        ids = _insert(conn, 3)
    with capture_logs() as logs:
        relay = new_store(Frontier())
    assert [e["event"] for e in logs] == ["outbox.frontier_unreadable"], logs
    assert relay.frontier.loaded
    assert relay.frontier.ready == (0, 0)
    assert relay.frontier.recheck == set()
    # outbox_stats and the admin's dashboard read the same saved frontier.
    with capture_logs() as logs, connection.cursor() as cur:
        assert stats.frontier_params(cur) == Frontier().params()
    assert [e["event"] for e in logs] == ["outbox.frontier_unreadable"], logs
    assert sorted(_publish_all(relay)) == ids


def _next_txid() -> int:
    with _connect() as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


def _ahead(position: str) -> dict[str, Any]:
    """A frontier as another cluster, or this one before a point-in-time recovery, saved it:
    one position past where this database stands."""
    state = Frontier().state()
    future_txid = str(_next_txid() + 1_000_000)
    if position == "ready":
        state["ready"] = [future_txid, 7]
    elif position == "scheduled":
        state["scheduled"] = [future_txid, 7]
    elif position == "late":
        state["late"] = [future_txid]
    else:  # saved on another cluster, or on a timeline a failover left: txids below xmax
        state["ready"] = [str(_next_txid() - 1), LAST_ID]
        state["cluster"] = "1234567890/00000001"
    return state


def _ready_and_due_rows(conn: psycopg.Connection[Any]) -> list[int]:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    return _insert(conn, 2) + _insert(conn, 1, retry_after=past)


@pytest.mark.parametrize("position", ["ready", "scheduled", "late", "cluster"])
def test_a_frontier_of_another_cluster_or_timeline_is_a_start_from_the_beginning(
    new_store: Any, position: str
) -> None:
    """A frontier saved in another cluster (pg_dump and restore, a move by logical
    replication), or ahead of where a point-in-time recovery went back to: every row written
    now may be behind it. The relay warns and starts from the beginning, and publishes them."""
    with _connect() as conn:
        ids = _ready_and_due_rows(conn)
        conn.execute(
            "INSERT INTO outbox_notify_frontier_v1 (max_version, state) VALUES (%s, %s)",
            [SCHEMA_VERSION, json.dumps(_ahead(position))],
        )
    with capture_logs() as logs:
        relay = new_store(Frontier())
    assert [e["event"] for e in logs] == ["outbox.frontier_ahead"], logs
    assert position in logs[0]["ahead"]
    assert relay.frontier.params() == Frontier().params()
    assert relay.frontier.cluster is not None
    assert relay.frontier.cluster != "1234567890/00000001"
    if position != "cluster":
        # outbox_stats and the admin's dashboard read the same saved frontier (by txid only:
        # they do not ask for the cluster's identity).
        with capture_logs() as logs, connection.cursor() as cur:
            assert stats.frontier_params(cur) == Frontier().params()
        assert [e["event"] for e in logs] == ["outbox.frontier_ahead"], logs
    assert sorted(_publish_all(relay)) == ids


def test_a_frontier_saved_by_an_older_release_is_a_quiet_start_from_the_beginning(
    new_store: Any,
) -> None:
    """No cluster in it: it may have been restored from any cluster, and its txids tell only
    when they are ahead. The relay starts from the beginning, once, without a warning."""
    state = Frontier().state()
    del state["cluster"]
    with _connect() as conn:
        ids = _ready_and_due_rows(conn)
        state["ready"] = [str(_next_txid() - 1), LAST_ID]
        state["scheduled"] = [str(_next_txid() - 1), LAST_ID]
        conn.execute(
            "INSERT INTO outbox_notify_frontier_v1 (max_version, state) VALUES (%s, %s)",
            [SCHEMA_VERSION, json.dumps(state)],
        )
    with capture_logs() as logs:
        relay = new_store(Frontier())
    assert logs == []
    assert relay.frontier.cluster is not None
    assert sorted(_publish_all(relay)) == ids


def test_a_frontier_saved_on_this_cluster_is_kept() -> None:
    """The identity check fires only on a change: a frontier this cluster saved is used."""
    frontier = Frontier()
    frontier.check(1_000, time.time(), "42/00000001")
    frontier.ready = (900, 5)
    saved = Frontier()
    saved.load(json.loads(json.dumps(frontier.state())))
    with capture_logs() as logs:
        saved.check(1_000, time.time(), "42/00000001")
        saved.check(1_000, time.time(), None)  # a server that does not tell: txids only
    assert logs == []
    assert saved.ready == (900, 5)


@pytest.mark.parametrize("went", ["ahead", "to another timeline"])
def test_a_relay_whose_database_went_back_in_time_starts_again_at_its_reconnect(
    new_store: Any, went: str
) -> None:
    """A relay running through a point-in-time recovery or a failover keeps its frontier in
    memory: its reconnect checks it against the database, as a start does. After a failover
    the new primary's txids may have caught up with the lost ones: the timeline tells."""
    relay = new_store(Frontier())
    with _connect() as conn:
        _insert(conn, 1)
    assert len(_publish_all(relay)) == 1
    with _connect() as conn:
        ids = _ready_and_due_rows(conn)
    # The database after going back: the rows above were written after the relay's
    # positions, in the database's own history, and are behind them.
    if went == "ahead":
        relay.frontier.ready = (_next_txid() + 1_000_000, 0)
    else:
        relay.frontier.ready = (_next_txid() - 1, LAST_ID)
        relay.frontier.cluster = f"{relay.frontier.cluster}-before"
    relay.frontier.due = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1), 0)
    relay.close()
    with capture_logs() as logs:
        relay.connect()
    assert [e["event"] for e in logs] == ["outbox.frontier_ahead"], logs
    assert sorted(_publish_all(relay)) == ids


def test_a_database_clock_gone_back_rereads_the_scheduled_rows_without_a_warning(
    new_store: Any,
) -> None:
    """A due position ahead of the database's clock (a clock step, a failover to a slower
    clock) would pass over rows due before it: read from the start again, silently."""
    relay = new_store(Frontier())
    relay.frontier.due = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1), 0)
    with _connect() as conn:
        ids = _ready_and_due_rows(conn)
    # Past the due row as a scheduled row, as a relay that saw it written: only the due
    # part can find it now.
    relay.frontier.scheduled = (_next_txid() - 1, LAST_ID)
    relay.close()
    with capture_logs() as logs:
        relay.connect()
    assert logs == []
    assert sorted(_publish_all(relay)) == ids


def _copy_in(txid: int) -> list[int]:
    """A ready and a due row as pg_restore writes them: with the txid of the cluster they
    were dumped from."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with _connect() as conn:
        return [
            row[0]
            for retry_after in (None, past)
            for row in conn.execute(
                "INSERT INTO outbox_notify_message_v1"
                " (task_id, task_name, args, kwargs, options, schema_version, retry_after, txid)"
                " VALUES ('copied', 'tests.add', '[]', '{}', '{}', %s, %s, %s::xid8) RETURNING id",
                [SCHEMA_VERSION, retry_after, str(txid)],
            ).fetchall()
        ]


def _txids(ids: list[int]) -> list[int]:
    with _connect() as conn:
        rows = conn.execute(
            "SELECT txid::text FROM outbox_notify_message_v1 WHERE id = ANY(%s)", [ids]
        ).fetchall()
    return [int(txid) for (txid,) in rows]


@pytest.mark.parametrize("batch", [5_000, 1])
def test_rows_copied_in_with_another_clusters_transaction_ids_are_stamped_at_connect(
    new_store: Any, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """pg_restore keeps each row's txid: rows copied from a busier cluster carry transaction
    ids this database has not handed out yet, and would sort after every new row. A relay
    that connects stamps them with its own transaction, in order with the rest, a batch of
    each kind per transaction."""
    monkeypatch.setattr(store_module, "RESTAMP_BATCH", batch)
    copied = _copy_in(_next_txid() + 1_000_000) + _copy_in(_next_txid() + 2_000_000)
    with capture_logs() as logs:
        relay = new_store(Frontier())
    assert [(e["event"], e.get("rows")) for e in logs] == [("outbox.copied_rows_stamped", 4)]
    assert all(txid < _next_txid() for txid in _txids(copied))
    assert sorted(_publish_all(relay)) == copied


def test_rows_copied_in_that_the_trigger_cannot_stamp_are_a_warning_not_a_loop(
    new_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the restamp trigger disabled, a pass stamps nothing: the relay says so and goes
    on (the claims still publish the rows, and never carry the frontier past them)."""
    monkeypatch.setattr(store_module, "RESTAMP_BATCH", 1)
    copied = _copy_in(_next_txid() + 1_000_000)
    with _connect() as conn:
        conn.execute(
            "ALTER TABLE outbox_notify_message_v1 DISABLE TRIGGER outbox_notify_restamp_v1"
        )
    try:
        with capture_logs() as logs:
            relay = new_store(Frontier())
    finally:
        with _connect() as conn:
            conn.execute(
                "ALTER TABLE outbox_notify_message_v1 ENABLE TRIGGER outbox_notify_restamp_v1"
            )
    assert [(e["event"], e.get("rows")) for e in logs] == [("outbox.copied_rows_unstamped", 2)]
    assert sorted(_publish_all(relay)) == copied


def test_rows_copied_in_while_a_relay_runs_leave_new_rows_ahead(new_store: Any) -> None:
    """Rows copied in after the relay connected: claiming them must not carry the frontier
    past the rows the database's own next transactions write."""
    relay = new_store(Frontier())
    copied = _copy_in(_next_txid() + 1_000_000)
    assert sorted(_publish_all(relay)) == copied
    with _connect() as conn:
        ids = _ready_and_due_rows(conn)
    assert sorted(_publish_all(relay)) == ids
    assert relay.frontier.ready[0] < _next_txid()
    assert relay.frontier.scheduled[0] < _next_txid()


class _Model:
    """What has been committed and published, to check the relays against at the end."""

    def __init__(self) -> None:
        self.committed: set[int] = set()
        self.published: list[int] = []


def _relay_step(rng: random.Random, store: ClaimStore, model: _Model) -> None:
    """One claim with a random ending: publish, retry some, release, or die."""
    with store.claim(rng.choice([1, 3, 10])) as claim:
        ids = [row.id for row in claim.rows]
        ending = rng.random()
        if ending < 0.1 and ids:
            return  # released untouched
        if ending < 0.15 and store.conn is not None:
            store.close()  # the session dies mid-claim: the server releases the rows
            store.connect()
            return
        retry = [i for i in ids if rng.random() < 0.2]
        published = [i for i in ids if i not in retry]
        claim.finish(
            Outcome(
                published=published,
                retry=[
                    Retry(id=i, retries=1, delay=rng.choice([0.0, 0.05]), error="x") for i in retry
                ],
            )
        )
        model.published += published


@pytest.mark.parametrize("seed", range(3))
def test_two_relays_among_slow_writers_publish_every_committed_row_once(
    seed: int, new_store: Any
) -> None:
    """Random writers (some slow, some holding rows for an instant) and two relays that retry,
    release and die: every committed row is published exactly once, nothing rolled back is."""
    rng = random.Random(seed)
    relays = [new_store(), new_store()]
    model = _Model()
    writers = [_connect(autocommit=False) for _ in range(4)]
    pending: dict[int, list[int]] = {w: [] for w in range(len(writers))}
    try:
        for _ in range(300):
            w = rng.randrange(len(writers))
            action = rng.random()
            if action < 0.35:
                eta = None
                if rng.random() < 0.2:
                    eta = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=rng.choice([-1, 0.05]))
                pending[w] += _insert(writers[w], rng.choice([1, 2, 5]), retry_after=eta)
            elif action < 0.45:
                writers[w].commit()
                model.committed.update(pending[w])
                pending[w] = []
            elif action < 0.5:
                writers[w].rollback()
                pending[w] = []
            else:
                _relay_step(rng, rng.choice(relays), model)
        for w, conn in enumerate(writers):
            conn.commit()
            model.committed.update(pending[w])
        time.sleep(0.1)  # every retry and held row is due now
        for relay in relays:
            model.published += _publish_all(relay)
    finally:
        for conn in writers:
            conn.close()
    assert sorted(model.published) == sorted(model.committed)
    with _connect() as conn:
        assert conn.execute("SELECT count(*) FROM outbox_notify_message_v1").fetchone() == (0,)
