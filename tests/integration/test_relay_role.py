"""sql/relay_role.sql: a relay logged in with only outbox_notify_relay's privileges works, and a
writer with only outbox_notify_writer's can enqueue.

Roles are cluster-wide, so this runs on a private PostgreSQL server of its own (never the
session's or the machine's), where PUBLIC's default rights on the schema are revoked first:
every privilege the relay uses must come from the script.
"""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql as pgsql

from devtools import pgserver
from outbox_notify.relay.store import ClaimStore
from tests.relay_support import ROOT, RedisQueue, run_python, wait_for

INSTALL_SQL = ROOT / "sql" / "install.sql"
ROLE_SQL = ROOT / "sql" / "relay_role.sql"
DATABASE = "role_test"
RELAY_LOGIN = "relay_login"
WRITER_LOGIN = "writer_login"
# Two attempts: the failing row is rescheduled once (UPDATE), then dead-lettered (INSERT).
FAST = ["--sweep-interval", "1", "--backoff-time", "0.2", "--max-backoff", "1", "--max-retries", "2"]  # fmt: skip
POISON_ID = "role-test-poison"
FAILING_ID = "role-test-failing"


def _psql(server: pgserver.PrivateServer, path: Path) -> None:
    argv = [
        "psql",
        "-X",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-d",
        server.url(DATABASE),
        "-f",
        str(path),
    ]
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def server() -> Iterator[pgserver.PrivateServer]:
    """A private cluster with the schema installed and the role script applied (twice)."""
    with pgserver.running() as srv:
        with psycopg.connect(srv.url(), autocommit=True) as conn:
            conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(DATABASE)))
        with psycopg.connect(srv.url(DATABASE), autocommit=True) as conn:
            conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
        _psql(srv, INSTALL_SQL)
        _psql(srv, ROLE_SQL)
        _psql(srv, ROLE_SQL)  # idempotent
        with psycopg.connect(srv.url(DATABASE), autocommit=True) as conn:
            for login, group in (
                (RELAY_LOGIN, "outbox_notify_relay"),
                (WRITER_LOGIN, "outbox_notify_writer"),
            ):
                conn.execute(
                    pgsql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                        pgsql.Identifier(login), pgsql.Identifier(group)
                    )
                )
        yield srv


def _as(server: pgserver.PrivateServer, login: str) -> psycopg.Connection[Any]:
    url = f"postgresql://{login}@{server.host}:{server.port}/{DATABASE}"
    return psycopg.connect(url, autocommit=True)


def _env(base: dict[str, Any], server: pgserver.PrivateServer, login: str) -> dict[str, Any]:
    return {
        **base,
        "OUTBOX_TEST_DATABASE_URL": f"postgresql://{login}@{server.host}:{server.port}/postgres",
        "OUTBOX_TEST_DB_NAME": DATABASE,
    }


def _enqueue_as_writer(env: dict[str, Any], queue: str) -> str:
    """The real write side (OutboxCelery in atomic()) in a subprocess logged in as the writer."""
    script = textwrap.dedent(
        f"""
        import django
        django.setup()
        from django.db import transaction
        from tests.celery_app import add
        with transaction.atomic():
            print(add.apply_async((20, 22), queue={queue!r}).id)
        """
    )
    return run_python(script, env, timeout=60)


def _insert_bad_rows(server: pgserver.PrivateServer, queue: str) -> None:
    """As the owner: one undecodable row (dead at once), one whose publish fails (retried)."""
    failing = {
        "headers": {"id": FAILING_ID, "task": "tests.add", "lang": "py"},
        "properties": {"correlation_id": FAILING_ID},
        "routing_key": queue,
        "exchange": "",
        "serializer": "no-such-serializer",
    }
    with psycopg.connect(server.url(DATABASE), autocommit=True) as conn:
        for task_id, options in ((POISON_ID, {}), (FAILING_ID, failing)):
            conn.execute(
                "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
                " schema_version) VALUES (%s, 'tests.add', '[1, 2]', '{}', %s, 1)",
                [task_id, json.dumps(options)],
            )


def _dead_letters(server: pgserver.PrivateServer) -> dict[str, str]:
    with psycopg.connect(server.url(DATABASE)) as conn:
        rows = conn.execute(
            "SELECT task_id, failure_reason FROM outbox_notify_dead_letter_v1"
        ).fetchall()
    return {str(task_id): str(reason) for task_id, reason in rows}


def test_relay_runs_with_only_the_relay_role(
    server: pgserver.PrivateServer,
    relay_env: dict[str, Any],
    start_relay: Any,
    redis_queue: RedisQueue,
) -> None:
    """Publish, retry (UPDATE), dead-letter (INSERT + sequence), LISTEN and locks all work."""
    task_id = _enqueue_as_writer(_env(relay_env, server, WRITER_LOGIN), redis_queue.name)
    _insert_bad_rows(server, redis_queue.name)
    relay = start_relay(*FAST, env=_env(relay_env, server, RELAY_LOGIN))
    wait_for(lambda: task_id in redis_queue.task_ids(), what="the message", context=relay.output)
    wait_for(
        lambda: set(_dead_letters(server)) == {POISON_ID, FAILING_ID},
        what="both bad rows dead-lettered",
        context=relay.output,
    )
    assert "publish failed 2 times" in _dead_letters(server)[FAILING_ID]
    wait_for(lambda: "outbox.database_connected mode=listen" in " ".join(relay.output().split()))
    with psycopg.connect(server.url(DATABASE)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_notify_message_v1").fetchone() == (0,)
    output = relay.output()
    assert "permission denied" not in output
    assert "outbox.database_unavailable" not in output


def _statsd_lines(sock: socket.socket, wanted: set[str], deadline: float) -> set[str]:
    """Metric names received on `sock` until every wanted one came or the deadline passed."""
    seen: set[str] = set()
    while not wanted <= seen and time.monotonic() < deadline:
        try:
            packet = sock.recv(65535).decode()
        except TimeoutError:
            continue
        seen |= {line.split(":", 1)[0] for line in packet.splitlines()}
    return seen


def test_relay_role_with_statsd_sends_gauges_without_reconnecting(
    server: pgserver.PrivateServer,
    relay_env: dict[str, Any],
    start_relay: Any,
    redis_queue: RedisQueue,
) -> None:
    """With StatsD on, the relay role's queue gauges go out and cost no reconnect.

    The gauges once read the dead-letter table, which the role may not: every gauge
    interval became a permission error, a full reconnect, and no gauge was ever sent.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(0.5)
        env = {
            **_env(relay_env, server, RELAY_LOGIN),
            "OUTBOX_TEST_STATSD_HOST": "127.0.0.1",
            "OUTBOX_TEST_STATSD_PORT": str(sock.getsockname()[1]),
        }
        task_id = _enqueue_as_writer(_env(relay_env, server, WRITER_LOGIN), redis_queue.name)
        relay = start_relay(*FAST, env=env)
        wanted = {"outbox_notify.queue.depth", "outbox_notify.queue.oldest_seconds"}
        wanted |= {"outbox_notify.published", "outbox_notify.lag"}
        seen = _statsd_lines(sock, wanted, time.monotonic() + 60)
        assert wanted <= seen, (seen, relay.output())
    wait_for(lambda: task_id in redis_queue.task_ids(), what="the message", context=relay.output)
    time.sleep(2 * 1.0)  # two sweep intervals more, for any failure to show
    output = relay.output()
    assert output.count("outbox.database_connected") == 1, output
    for failure in ("outbox.database_unavailable", "outbox.gauges_failed", "permission denied"):
        assert failure not in output, output


def test_relay_role_cannot_write_messages_or_read_dead_letters(
    server: pgserver.PrivateServer,
) -> None:
    """The relay role has no INSERT on the outbox, and may count the dead letters (its
    gauge) but read none of a dead letter's message."""
    with _as(server, RELAY_LOGIN) as conn:
        with pytest.raises(pg_errors.InsufficientPrivilege):
            conn.execute(
                "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
                " schema_version) VALUES ('x', 'x', '[]', '{}', '{}', 1)"
            )
        assert conn.execute("SELECT count(*) FROM outbox_notify_dead_letter_v1").fetchone()
        for column in ("task_name", "args", "kwargs", "failure_reason"):
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(f"SELECT {column} FROM outbox_notify_dead_letter_v1")  # noqa: S608


# The columns finalize_batch reschedules; every other column is the writer's alone.
RELAY_WRITES = ("retries", "retry_after", "last_error")


def _message_columns(server: pgserver.PrivateServer) -> list[str]:
    with psycopg.connect(server.url(DATABASE)) as conn:
        rows = conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'outbox_notify_message_v1'::regclass"
            " AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        ).fetchall()
    return [str(name) for (name,) in rows]


def test_relay_role_locks_rows_but_updates_only_the_columns_it_writes(
    server: pgserver.PrivateServer,
) -> None:
    """Column UPDATE grants still allow FOR UPDATE SKIP LOCKED; any other column is refused."""
    other = [c for c in _message_columns(server) if c not in RELAY_WRITES]
    assert {"task_name", "args", "options", "schema_version"} <= set(other)
    with _as(server, RELAY_LOGIN) as conn:
        with conn.transaction():
            conn.execute("SELECT id FROM outbox_notify_message_v1 FOR UPDATE SKIP LOCKED")
            conn.execute(
                "UPDATE outbox_notify_message_v1 SET retries = retries,"
                " retry_after = retry_after, last_error = last_error"
            )
        for column in other:
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(
                    pgsql.SQL("UPDATE outbox_notify_message_v1 SET {0} = {0}").format(
                        pgsql.Identifier(column)
                    )
                )


def test_relay_role_reads_the_clusters_identity_and_does_without_it_where_refused(
    server: pgserver.PrivateServer,
) -> None:
    """The frontier check asks for the cluster's identity (pg_control_system(),
    pg_walfile_name()), granted to everyone by default. Where a service revokes it, the relay
    still starts and claims, and the check compares transaction ids only."""
    login = {"host": server.host, "port": server.port, "dbname": DATABASE, "user": RELAY_LOGIN}
    with psycopg.connect(server.url(DATABASE), autocommit=True) as owner:
        owner.execute(
            "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version) VALUES ('identity', 'tests.add', '[]', '{}', '{}', 1)"
        )
        store = ClaimStore(login, stale_timeout=30)
        store.connect()
        try:
            assert store.frontier.cluster is not None
        finally:
            store.close()
        owner.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
        owner.execute("DELETE FROM outbox_notify_frontier_v1")  # the identity saved just now
        try:
            store = ClaimStore(login, stale_timeout=30)
            store.connect()
            try:
                assert store.frontier.cluster is None
                with store.claim(100) as claim:
                    assert "identity" in [row.task_id for row in claim.rows]
            finally:
                store.close()
        finally:
            owner.execute("GRANT EXECUTE ON FUNCTION pg_control_system() TO PUBLIC")
            owner.execute("DELETE FROM outbox_notify_message_v1 WHERE task_id = 'identity'")


def test_role_script_takes_back_an_earlier_table_wide_update(
    server: pgserver.PrivateServer,
) -> None:
    """Run over an earlier version's table-wide UPDATE grant, the script leaves column grants."""
    check = (
        "SELECT has_table_privilege('outbox_notify_relay', 'outbox_notify_message_v1', 'UPDATE'),"
        " array_agg(attname ORDER BY attnum) FILTER (WHERE has_column_privilege("
        "'outbox_notify_relay', attrelid, attnum, 'UPDATE'))"
        " FROM pg_attribute WHERE attrelid = 'outbox_notify_message_v1'::regclass"
        " AND attnum > 0 AND NOT attisdropped"
    )
    with psycopg.connect(server.url(DATABASE), autocommit=True) as conn:
        try:
            conn.execute("GRANT UPDATE ON outbox_notify_message_v1 TO outbox_notify_relay")
            assert conn.execute(check).fetchone() == (True, _message_columns(server))
            _psql(server, ROLE_SQL)
            assert conn.execute(check).fetchone() == (False, list(RELAY_WRITES))
        finally:
            _psql(server, ROLE_SQL)  # the other tests of this module see the script's grants


def test_writer_role_can_only_insert(server: pgserver.PrivateServer) -> None:
    """The writer role inserts messages but can neither read, change nor delete them."""
    with _as(server, WRITER_LOGIN) as conn:
        for statement in (
            "SELECT 1 FROM outbox_notify_message_v1",
            "DELETE FROM outbox_notify_message_v1",
            "UPDATE outbox_notify_message_v1 SET retries = 0",
            "INSERT INTO outbox_notify_dead_letter_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version, retries, failure_reason, created_at)"
            " VALUES ('x', 'x', '[]', '{}', '{}', 1, 0, 'x', now())",
        ):
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(statement)


def test_writer_role_records_once_keys_but_cannot_remove_them(
    server: pgserver.PrivateServer,
) -> None:
    """OnceTask's statements work as the writer (a worker's login); deleting keys does not."""
    from outbox_notify import inbox

    params = {"scope": "tests.once", "key": "k-1", "task_id": "t-1", "task_name": "tests.once"}
    with _as(server, WRITER_LOGIN) as conn:
        inserted = [conn.execute(inbox.queries()["record_key"], params).rowcount for _ in "ab"]
        assert inserted == [1, 0]
        renamed = dict(params, key="k-2", former="k-1")  # an event's key and its former one
        assert conn.execute(inbox.queries()["record_key_unless_former"], renamed).rowcount == 0
        owner = conn.execute(inbox.queries()["key_owner"], params).fetchone()
        assert owner == ("t-1",)
        for statement in (
            "DELETE FROM outbox_notify_inbox_v1",
            "UPDATE outbox_notify_inbox_v1 SET key = 'x'",
        ):
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(statement)
    with _as(server, RELAY_LOGIN) as conn, pytest.raises(pg_errors.InsufficientPrivilege):
        conn.execute("SELECT 1 FROM outbox_notify_inbox_v1")
