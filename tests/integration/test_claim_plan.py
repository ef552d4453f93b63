"""The claim reads its two indexes in order whatever the table's statistics say.

An outbox table is mostly empty, so autovacuum analyses it while it is empty (or has not yet:
a new install). When a burst then arrives, the planner guesses a few hundred ready rows, and
a claim of more rows than it guesses used to become a scan of the whole table and a sort of
every row, at every claim until the next analyse: 270 ms per claim of 2,000 out of 100,000
fresh rows instead of 11 ms (RabbitMQ drain, `python -m devtools.amqp_drain --backlog 100000
--batch-size 2000`: 6,400-7,200 msg/s before, 13,200-13,900 after).

The plan is read from the claim connection itself with auto_explain, which reports every
statement's plan to the client as a NOTICE: so this is the claim as the relay runs it.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from psycopg import sql as pg_sql
from structlog.testing import capture_logs

from outbox_notify.exceptions import DatabaseUnavailable
from outbox_notify.models import OutboxMessage
from outbox_notify.relay import runner
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.store import PREPARE_THRESHOLD, ClaimStore, Outcome, Preparing

ROWS = 5_000
BATCH = 2_000


def _burst_after_an_empty_analyse(retrying: int) -> None:
    with connection.cursor() as cur:
        cur.execute("ANALYZE outbox_notify_message_v1")  # while it is empty
        cur.execute(
            "INSERT INTO outbox_notify_message_v1"
            " (task_id, task_name, args, kwargs, options, schema_version, retry_after)"
            " SELECT gen_random_uuid()::text, 'tests.add', '[1, 2]', '{}', '{}', 1,"
            "        CASE WHEN n <= %s THEN now() - interval '1 minute' END"
            " FROM generate_series(1, %s) AS n",
            [retrying, ROWS],
        )


def _explaining_store() -> tuple[ClaimStore, list[str]]:
    """A connected claim store whose every statement's plan auto_explain reports to the client
    as a NOTICE, collected in the list returned with it (the caller closes the store)."""
    store = ClaimStore(runner.connection_kwargs("default"), stale_timeout=30)
    store.connect()
    assert store.conn is not None
    plans: list[str] = []
    store.conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
    try:
        with store.conn.transaction():
            store.conn.execute("LOAD 'auto_explain'")
        store.conn.execute("SET auto_explain.log_min_duration = 0")
        store.conn.execute("SET auto_explain.log_level = 'notice'")
        store.conn.commit()
    except BaseException:
        store.close()
        raise
    return store, plans


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("retrying", [0, 3_000], ids=["ready rows", "due retries"])
def test_a_claim_after_a_burst_on_an_empty_analysed_table_reads_only_its_indexes(
    retrying: int,
) -> None:
    _burst_after_an_empty_analyse(retrying)
    store, plans = _explaining_store()
    try:
        plans.clear()
        with store.claim(BATCH) as claim:
            assert len(claim.rows) == BATCH
        claim_plans = [p for p in plans if "outbox_notify_message_v1_ready_txid_idx" in p]
        assert len(claim_plans) == 1, plans
        plan = claim_plans[0]
        assert "Index Scan using outbox_notify_message_v1_ready_txid_idx" in plan, plan
        assert "Index Scan using outbox_notify_message_v1_scheduled_idx" in plan, plan
        for node in ("Seq Scan", "Bitmap", "Sort"):
            assert node not in plan, plan
    finally:
        store.close()


def _insert(rows: int) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO outbox_notify_message_v1"
            " (task_id, task_name, args, kwargs, options, schema_version)"
            " SELECT gen_random_uuid()::text, 'tests.add', '[1, 2]', '{}', '{}', 1"
            " FROM generate_series(1, %s)",
            [rows],
        )


# The relay's connections prepare every statement at its first execution, so the lookups of
# pg_prepared_statements below run with prepare=False and leave out their own text anyway:
# none may count itself.
def _prepared_claims(store: ClaimStore) -> int:
    """Claim statements prepared on the claim connection (read on it, outside any claim)."""
    assert store.conn is not None
    row = store.conn.execute(
        "SELECT count(*) FROM pg_prepared_statements"
        " WHERE (statement LIKE '%%outbox_notify_message_v1_%%' OR statement LIKE '%%AS part%%')"
        " AND statement NOT LIKE '%%pg_prepared_statements%%'",
        prepare=False,
    ).fetchone()
    store.conn.commit()
    return int(row[0]) if row else 0


@pytest.mark.django_db(transaction=True)
def test_a_claim_that_finds_nothing_or_lets_its_rows_go_keeps_the_claim_prepared() -> None:
    """psycopg drops every prepared statement of a connection that rolls back, and the claim
    would be planned anew at its next executions (ClaimStore.release)."""
    store = ClaimStore(
        runner.connection_kwargs("default"), stale_timeout=30, preparing=Preparing(allowed=True)
    )
    store.connect()
    store.session_proven()
    try:
        _insert(3)
        with store.claim(10) as claim:  # prepared at its first execution (PREPARE_THRESHOLD)
            claim.finish(Outcome(published=[r.id for r in claim.rows]))
        assert _prepared_claims(store) >= 1, (
            list(store.conn._prepared._names) if store.conn else None
        )
        with store.claim(10) as claim:
            assert claim.rows == []
        assert _prepared_claims(store) >= 1, "an empty claim dropped the prepared claim"
        _insert(2)
        with store.claim(10) as claim:
            let_go = [r.id for r in claim.rows]
            assert len(let_go) == 2
        assert _prepared_claims(store) >= 1, "letting rows go dropped the prepared claim"
        # The rows let go are free at once, for another session too.
        with connection.cursor() as cur:
            cur.execute(
                "SELECT id FROM outbox_notify_message_v1 WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED",
                [let_go],
            )
            assert len(cur.fetchall()) == 2
        with store.claim(10) as claim:
            assert sorted(r.id for r in claim.rows) == sorted(let_go)
            claim.finish(Outcome(published=let_go))
        # A new connection may lead elsewhere: it prepares once its own probe went through.
        store.connect()
        assert store.conn is not None
        assert store.conn.prepare_threshold is None
        store.session_proven()
        assert store.conn.prepare_threshold == PREPARE_THRESHOLD
    finally:
        store.close()


def _claim_connection(relay: Relay) -> psycopg.Connection[Any]:
    store = relay.store
    store = getattr(store, "inner", store)  # under the tracing wrapper
    assert isinstance(store, ClaimStore)
    assert store.conn is not None
    return store.conn


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("options", "listen", "prepares"),
    [
        ({}, True, True),
        ({}, False, False),  # poll-only: nothing proves a session of its own
        ({"prepare_threshold": None}, True, False),  # the alias's word
        ({"prepare_threshold": 2}, True, True),
    ],
    ids=["listening", "polling", "OPTIONS say no", "OPTIONS say yes"],
)
def test_a_relay_prepares_its_claims_once_listen_proves_a_session_of_its_own(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], listen: bool, prepares: bool
) -> None:
    """Django turns prepared statements off for poolers' sake; the LISTEN probe, sent from
    the claim connection, proves there is none, and the claim is then planned once."""
    alias = connections["default"]
    monkeypatch.setitem(
        alias.settings_dict, "OPTIONS", {**alias.settings_dict["OPTIONS"], **options}
    )
    relay = runner.build_relay(RelayConfig(poll_only=not listen), listen=listen, wake_fd=None)
    relay.ensure_connected()
    try:
        assert relay.polling is not listen
        for _ in range(8):
            _insert(2)
            with relay.store.claim(10) as claim:
                claim.finish(Outcome(published=[r.id for r in claim.rows]))
        conn = _claim_connection(relay)
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%AS part%%'"
            " AND statement NOT LIKE '%%pg_prepared_statements%%'",
            prepare=False,
        ).fetchone()
        conn.commit()
        assert (row is not None and row[0] >= 1) is prepares
    finally:
        relay.disconnect()


@pytest.mark.django_db(transaction=True)
def test_a_listening_relay_plans_its_peek_once() -> None:
    """The peek runs before every sleep: prepared, with its generic plan kept. Left to choose,
    PostgreSQL found its custom plans cheaper and planned it at every peek."""
    relay = runner.build_relay(RelayConfig(), listen=True, wake_fd=None)
    relay.ensure_connected()
    try:
        listener = relay.listener
        assert listener is not None
        for n in range(12):
            if n % 3 == 0:  # the frontier moves between peeks, as claims move it
                _insert(1)
                with relay.store.claim(10) as claim:
                    claim.finish(Outcome(published=[r.id for r in claim.rows]))
            listener.peek()
        conn = listener._connection()
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%Before sleeping%%'"
            " AND statement NOT LIKE '%%pg_prepared_statements%%'",
            prepare=False,
        ).fetchall()
        # One prepared statement per set of parameter types: the frontier's first peek, with
        # nothing read yet, may send other types than the later ones.
        assert plans, "the peek was not prepared"
        assert all(custom == 0 for _generic, custom in plans), plans
        assert max(generic for generic, _custom in plans) >= 10, plans
    finally:
        relay.disconnect()


@pytest.mark.django_db(transaction=True)
def test_a_prepared_statement_the_server_no_longer_knows_turns_preparing_off_for_good() -> None:
    """What a transaction pooler that does not track prepared statements does to a relay the
    LISTEN probe let prepare: the server refuses the statement. The claim fails as a database
    outage (the relay reconnects), and the store prepares nothing from then on."""
    store = ClaimStore(
        runner.connection_kwargs("default"), stale_timeout=30, preparing=Preparing(allowed=True)
    )
    store.connect()
    store.session_proven()
    try:
        for _ in range(6):
            _insert(2)
            with store.claim(10) as claim:
                claim.finish(Outcome(published=[r.id for r in claim.rows]))
        assert store.conn is not None
        names = [
            name
            for (name,) in store.conn.execute(
                "SELECT name FROM pg_prepared_statements WHERE statement LIKE '%%AS part%%'"
                " AND statement NOT LIKE '%%pg_prepared_statements%%'",
                prepare=False,
            ).fetchall()
        ]
        assert names
        # DEALLOCATE by name (every shape of the claim prepared so far): psycopg does not
        # notice (it drops its cache only on DEALLOCATE ALL), as it cannot notice another
        # client's pooler reusing the session.
        for name in names:
            store.conn.execute(pg_sql.SQL("DEALLOCATE {}").format(pg_sql.Identifier(name)))
        store.conn.commit()
        _insert(2)
        with capture_logs() as logs, pytest.raises(DatabaseUnavailable), store.claim(10):
            pass
        assert [e["event"] for e in logs] == ["outbox.prepared_statements_refused"]
        store.connect()  # as the relay does after a DatabaseUnavailable
        store.session_proven()  # its next probe goes through again
        for _ in range(6):
            with store.claim(10) as claim:
                claim.finish(Outcome(published=[r.id for r in claim.rows]))
        assert _prepared_claims(store) == 0
        assert not OutboxMessage.objects.exists()
    finally:
        store.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("recheck", [False, True])
@pytest.mark.parametrize("late", [False, True])
def test_each_shape_of_the_claim_takes_what_its_parts_find(recheck: bool, late: bool) -> None:
    """A claim leaves out the recheck and late parts while they have nothing to read; with
    something to read, the part is in and finds its rows: a row behind the ready frontier,
    known by id (recheck) or by its transaction (late)."""
    store = ClaimStore(runner.connection_kwargs("default"), stale_timeout=30)
    store.connect()
    try:
        _insert(3)
        with store.claim(10) as claim:  # moves the ready frontier past these rows
            claim.finish(Outcome(published=[r.id for r in claim.rows]))
        _insert(1)
        behind = OutboxMessage.objects.order_by("-id").values_list("id", flat=True)[0]
        with connection.cursor() as cur:
            cur.execute("SELECT txid::text FROM outbox_notify_message_v1 WHERE id = %s", [behind])
            found = cur.fetchone()
        assert found is not None
        txid = found[0]
        # The row's position is behind the frontier from now on: only its part can find it.
        store.frontier.ready = (int(txid) + 1, 0)
        if recheck:
            store.frontier.recheck = {behind}
        if late:
            store.frontier.late = {int(txid)}
        store.claim_shapes.clear()
        with store.claim(10) as claim:
            taken = [r.id for r in claim.rows]
            claim.finish(Outcome(published=taken))
        assert list(store.claim_shapes) == [(recheck, late)]
        assert taken == ([behind] if recheck or late else [])
        # Each part read to its end: the row and its transaction are not looked up again.
        assert behind not in store.frontier.recheck
        assert int(txid) not in store.frontier.late
    finally:
        store.close()


def _prepared(store: ClaimStore) -> list[tuple[str, int, int]]:
    """The relay's own statements prepared on the claim connection: (text, generic plans,
    custom plans), read outside any claim."""
    assert store.conn is not None
    found = store.conn.execute(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement NOT LIKE '%%pg_prepared_statements%%'",
        prepare=False,
    ).fetchall()
    store.conn.commit()
    return [(text, generic, custom) for text, generic, custom in found]


@pytest.mark.django_db(transaction=True)
def test_the_claim_is_prepared_in_each_shape_before_the_first_claim() -> None:
    """Once the probe proves a session of its own, the claim's four shapes, the finalising
    delete and the frontier's save are planned at once, not inside the first claims; the
    warm-up takes no row."""
    _insert(3)
    store = ClaimStore(
        runner.connection_kwargs("default"), stale_timeout=30, preparing=Preparing(allowed=True)
    )
    store.connect()
    try:
        assert _prepared(store) == []
        store.session_proven()
        prepared = _prepared(store)
        claims = [text for text, _, _ in prepared if "AS part" in text]
        assert len(claims) == 4, prepared
        assert sum("_recheck" in text or "rechecked" in text for text in claims) == 2, claims
        assert sum("late_ready" in text for text in claims) == 2, claims
        for statement in ("DELETE FROM outbox_notify_message_v1 WHERE id = ANY", "SET state ="):
            assert any(statement in text for text, *_ in prepared), (statement, prepared)
        assert all(
            generic == 1 and custom == 0 for text, generic, custom in prepared if "AS part" in text
        )
        # Nothing was taken, nor ever locked (a row lock leaves its locker in xmax).
        with connection.cursor() as cur:
            cur.execute("SELECT xmax::text FROM outbox_notify_message_v1")
            assert [xmax for (xmax,) in cur.fetchall()] == ["0"] * 3
        with store.claim(10) as claim:
            assert len(claim.rows) == 3
            claim.finish(Outcome(published=[r.id for r in claim.rows]))
        assert not OutboxMessage.objects.exists()
        # Claims of every shape, with real rows to recheck and transactions to look up, find
        # the statements the warm-up prepared: its stand-in lists had the same types.
        _insert(1)
        with connection.cursor() as cur:
            cur.execute("SELECT id, txid::text FROM outbox_notify_message_v1")
            found = cur.fetchone()
        assert found is not None
        row_id, txid = found[0], int(found[1])
        for recheck in (False, True):
            for late in (False, True):
                store.frontier.recheck = {row_id} if recheck else set()
                store.frontier.late = {txid} if late else set()
                with store.claim(10) as claim:
                    pass  # let go untouched: the row stays for the next shape
        assert len(_prepared(store)) == len(prepared), "a claim prepared a statement again"
    finally:
        store.close()


@pytest.mark.django_db(transaction=True)
def test_one_shape_of_the_claim_is_prepared_once_whatever_its_positions_values() -> None:
    """psycopg would send a small id as a smallint and a larger one as an integer or a bigint,
    and prepare the claim again for each mix of types; the relay's connections send every
    int as a bigint, so the claim of one shape is prepared (and planned) once."""
    store = ClaimStore(
        runner.connection_kwargs("default"), stale_timeout=30, preparing=Preparing(allowed=True)
    )
    store.connect()
    store.session_proven()
    try:
        for ready_id in (0, 40_000, 2**40):
            store.frontier.recheck.clear()
            store.frontier.late.clear()
            store.frontier.ready = (store.frontier.ready[0], ready_id)
            with store.claim(10) as claim:
                assert claim.rows == []
        shape, _ = store.claim_shape(False, False)
        copies = [text for text, _, _ in _prepared(store) if text == shape]
        assert len(copies) == 1, copies
    finally:
        store.close()


# What an index scan of the outbox may read: a node's name and the lines under it, up to the
# next node.
_SCAN = re.compile(r"Index (?:Only )?Scan(?: Backward)? using (\w+) on outbox_notify_message_v1")


def _scans(plan: str) -> list[tuple[str, str, str]]:
    """(index, its Index Cond or '', the statement's first line) for each index scan of the
    outbox table in an auto_explain plan."""
    lines = plan.splitlines()
    statement = next((line for line in lines if line.startswith("Query Text:")), "")
    found = []
    for at, line in enumerate(lines):
        scan = _SCAN.search(line)
        if scan is None:
            continue
        cond = ""
        for below in lines[at + 1 :]:
            if "->" in below:
                break
            if "Index Cond:" in below:
                cond = below.split("Index Cond:", 1)[1].strip()
                break
        found.append((scan.group(1), cond, statement[:100]))
    return found


@pytest.mark.django_db(transaction=True)
def test_no_plan_reads_an_index_from_its_start_as_dead_rows_pile_up() -> None:
    """Behind an old snapshot, rows published stay in every index. The claim, the peek and the
    gauges each keep one generic plan, made again after every autovacuum round with that
    round's statistics; whatever those say, no index scan of theirs may start at the start of
    an index: each has an index condition, and the primary key is read by id or from an id on.
    Before, some rounds' plans read the primary key from its start for one part of the claim
    (`m.id <= ...`), and every plan read the scheduled rows' (txid, id) index whole."""
    store, plans = _explaining_store()
    holder = psycopg.connect(**runner.connection_kwargs("default"), application_name="tests.old")
    writer = psycopg.connect(**runner.connection_kwargs("default"), autocommit=True)
    try:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        seen: set[tuple[str, str, str]] = set()
        for _ in range(6):  # an autovacuum round after every 10,000 rows published
            for _ in range(20):
                for _ in range(5):
                    writer.execute(
                        "INSERT INTO outbox_notify_message_v1"
                        " (task_id, task_name, args, kwargs, options, schema_version,"
                        "  retry_after)"
                        " SELECT gen_random_uuid()::text, 'tests.add', '[]', '{}', '{}', 1,"
                        "        CASE WHEN n <= 10 THEN now() - interval '1 second' END"
                        " FROM generate_series(1, 100) AS n"
                    )
                with store.claim(BATCH) as claim:
                    claim.finish(Outcome(published=[r.id for r in claim.rows]))
            writer.execute("ANALYZE outbox_notify_message_v1")
            writer.execute("VACUUM outbox_notify_message_v1")
            plans.clear()
            writer.execute(
                "INSERT INTO outbox_notify_message_v1"
                " (task_id, task_name, args, kwargs, options, schema_version)"
                " SELECT gen_random_uuid()::text, 'tests.add', '[]', '{}', '{}', 1"
                " FROM generate_series(1, 300)"
            )
            with store.claim(100) as claim:  # fills up: stops inside a transaction
                claim.finish(Outcome(published=[r.id for r in claim.rows]))
            with store.claim(BATCH) as claim:  # does not fill up
                claim.finish(Outcome(published=[r.id for r in claim.rows]))
            store.peek()
            store.queue_gauges()
            for plan in plans:
                seen.update(_scans(plan))
        assert seen, plans
        for index, cond, statement in sorted(seen):
            # The oldest-pending gauge reads the failed rows' index from its start on purpose:
            # it holds only rows that failed (_oldest_pending).
            assert cond or index == "outbox_notify_message_v1_failed_idx", (index, statement)
            if index.endswith("_pkey"):
                assert re.match(r"\(+id (= ANY|>)", cond), (index, cond, statement)
        assert {index for index, _, _ in seen} >= {
            "outbox_notify_message_v1_ready_txid_idx",
            "outbox_notify_message_v1_scheduled_idx",
        }
    finally:
        holder.close()
        writer.close()
        store.close()
