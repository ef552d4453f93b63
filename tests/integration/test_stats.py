"""outbox_stats and its core, stats.collect(), against a real PostgreSQL."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from outbox_notify import stats
from outbox_notify.relay.runner import connection_kwargs
from tests.relay_support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: stats are read by other sessions (a psycopg connection, the relay-like
# sessions below) and from planner statistics that ANALYZE gathers from committed rows only.

INSERT_MESSAGE = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, retry_after, created_at)
VALUES (%s, %s, '[]', '{}', '{"headers": {}}', 1, %s,
        now() + make_interval(secs => %s), now() - make_interval(secs => %s))
"""
INSERT_DEAD = """
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, failure_reason,
     created_at)
VALUES (%s, %s, '[]', '{}', '{"headers": {}}', 1, %s, 'boom', now())
"""


def add_message(
    task_name: str = "tests.add",
    *,
    retries: int = 0,
    retry_in: float | None = None,
    age: float = 0.0,
) -> None:
    """Insert one outbox row; retry_in seconds from now sets retry_after (None: never tried)."""
    with connections["default"].cursor() as cur:
        cur.execute(INSERT_MESSAGE, [str(uuid.uuid4()), task_name, retries, retry_in, age])


def add_dead_letter(task_name: str, retries: int = 5) -> None:
    """Insert one dead letter."""
    with connections["default"].cursor() as cur:
        cur.execute(INSERT_DEAD, [str(uuid.uuid4()), task_name, retries])


def connect(application_name: str = "tests", autocommit: bool = True) -> psycopg.Connection:
    """A psycopg connection to the test database, as a relay would open one."""
    params = connection_kwargs("default")
    params["application_name"] = application_name
    return psycopg.connect(**params, autocommit=autocommit)


@pytest.fixture
def django_connection() -> object:
    """The Django connection the commands use."""
    return connections["default"]


@pytest.fixture
def relay_sessions() -> Iterator[tuple[psycopg.Connection, psycopg.Connection]]:
    """A LISTEN session and a claim session with an open transaction, named as relays name them."""
    listen = connect("outbox_notify.listen")
    listen.execute("LISTEN outbox_notify_v1")
    claim = connect("outbox_notify.claim", autocommit=False)
    claim.execute(
        "SELECT id FROM outbox_notify_message_v1 ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED"
    )
    yield listen, claim
    claim.close()
    listen.close()


def test_empty_outbox_gives_exact_zeros(django_connection: object) -> None:
    """With no rows every count is exactly 0 and nothing is reported as lagging."""
    snapshot = stats.collect(django_connection)
    assert (snapshot.queue_depth, snapshot.due_now, snapshot.retrying) == (0, 0, 0)
    assert snapshot.dead_letter_count == 0
    assert snapshot.oldest_pending_seconds == 0.0
    assert snapshot.top_failing == ()
    assert snapshot.notify_queue_usage == 0.0
    assert all(snapshot.exact.values())


def test_counts_split_pending_rows_into_due_and_retrying(django_connection: object) -> None:
    """Never-tried and past-due rows are due now; rows whose retry_after is ahead are retrying."""
    add_message(age=3600)
    add_message()
    add_message(retries=1, retry_in=-5)
    add_message(retries=2, retry_in=600)
    add_message(retries=1, retry_in=600)
    add_dead_letter("tests.add")
    snapshot = stats.collect(django_connection)
    assert snapshot.queue_depth == 5
    assert snapshot.retrying == 2
    assert snapshot.due_now == 3
    assert snapshot.dead_letter_count == 1
    assert 3600 <= snapshot.oldest_pending_seconds < 3700
    assert snapshot.exact == {
        "queue_depth": True,
        "due_now": True,
        "retrying": True,
        "dead_letter_count": True,
        "top_failing": True,
        "events": True,
    }


def test_top_failing_ranks_task_names_by_retries_over_outbox_and_dead_letters(
    django_connection: object,
) -> None:
    """top_failing adds outbox retries and dead letters per task name, most retries first."""
    add_message("tests.flaky", retries=3, retry_in=60)
    add_message("tests.flaky", retries=1, retry_in=60)
    add_message("tests.fine")
    add_dead_letter("tests.dead", retries=5)
    add_dead_letter("tests.dead", retries=5)
    add_dead_letter("tests.flaky", retries=1)
    snapshot = stats.collect(django_connection, top=2)
    assert [t.task_name for t in snapshot.top_failing] == ["tests.dead", "tests.flaky"]
    dead, flaky = snapshot.top_failing
    assert (dead.retries, dead.failing, dead.dead_letters) == (10, 0, 2)
    assert (flaky.retries, flaky.failing, flaky.dead_letters) == (5, 2, 1)


def test_large_tables_switch_to_estimates_and_say_so(django_connection: object) -> None:
    """Past the exact limit, counts come from the planner and `exact` marks them estimated."""
    for _ in range(40):
        add_message()
    for _ in range(30):
        add_dead_letter("tests.dead")
    with connections["default"].cursor() as cur:
        cur.execute("ANALYZE outbox_notify_message_v1, outbox_notify_dead_letter_v1")
    snapshot = stats.collect(django_connection, exact_limit=10, failing_window=10)
    assert not snapshot.exact["queue_depth"]
    assert not snapshot.exact["dead_letter_count"]
    assert not snapshot.exact["due_now"]
    assert not snapshot.exact["top_failing"]
    assert snapshot.exact["retrying"]
    assert snapshot.queue_depth == 40
    assert snapshot.dead_letter_count == 30


def test_estimate_is_never_below_what_was_counted(django_connection: object) -> None:
    """Before any ANALYZE the estimate may be low; the figure is at least the rows counted."""
    for _ in range(20):
        add_message()
    snapshot = stats.collect(django_connection, exact_limit=5)
    assert not snapshot.exact["queue_depth"]
    assert snapshot.queue_depth >= 6


def test_relay_sessions_are_seen_in_pg_stat_activity(
    django_connection: object, relay_sessions: tuple[psycopg.Connection, psycopg.Connection]
) -> None:
    """A LISTEN session counts as a relay; a claim session inside a transaction as an open claim."""
    _, claim = relay_sessions
    snapshot = stats.collect(django_connection)
    assert snapshot.relays_listening == 1
    assert snapshot.claims_open == 1
    assert snapshot.oldest_claim_seconds >= 0.0
    claim.commit()
    assert stats.collect(django_connection).claims_open == 0


def test_collect_accepts_a_psycopg_connection_and_leaves_it_idle() -> None:
    """collect() takes a plain psycopg connection and does not leave it idle in transaction."""
    add_message(retries=1, retry_in=60)
    with connect(autocommit=False) as conn:
        snapshot = stats.collect(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert (snapshot.queue_depth, snapshot.retrying) == (1, 1)


def run_stats(*args: str) -> str:
    """Run outbox_stats in-process and return its standard output."""
    out = io.StringIO()
    call_command("outbox_stats", *args, stdout=out)
    return out.getvalue()


def test_json_format_has_the_documented_keys() -> None:
    """--format json prints one object with every documented key."""
    add_message("tests.flaky", retries=2, retry_in=60)
    data = json.loads(run_stats("--format", "json", "--top", "1"))
    assert {
        "queue_depth",
        "dead_letter_count",
        "oldest_pending_seconds",
        "top_failing",
        "notify_queue_usage",
        "due_now",
        "retrying",
        "relays_listening",
        "claims_open",
        "oldest_claim_seconds",
        "dead_rows",
        "dead_rows_held",
        "oldest_snapshot",
        "exact",
    } <= set(data)
    assert data["queue_depth"] == 1
    assert data["top_failing"] == [
        {"task_name": "tests.flaky", "failing": 1, "dead_letters": 0, "retries": 2}
    ]


def test_text_format_lists_the_figures() -> None:
    """The default text format names each figure on its own line."""
    add_message("tests.flaky", retries=2, retry_in=60)
    text = run_stats()
    assert "queue_depth            1" in text
    assert "tests.flaky  retries=2 failing=1 dead_letters=0" in text


def test_fail_if_lag_above_exits_2_only_when_the_oldest_row_is_older() -> None:
    """--fail-if-lag-above exits with code 2 when the oldest pending row is older than allowed."""
    add_message(age=120)
    assert json.loads(run_stats("--format", "json", "--fail-if-lag-above", "300"))
    with pytest.raises(CommandError) as excinfo:
        run_stats("--format", "json", "--fail-if-lag-above", "60")
    assert excinfo.value.returncode == 2
    assert "above --fail-if-lag-above=60" in str(excinfo.value)


def test_manage_py_exit_code_is_2_when_lagging(subprocess_env: dict[str, Any]) -> None:
    """Run as a real process (as a probe does), outbox_stats exits 2 above the lag limit, else 0."""
    add_message(age=120)
    command = [sys.executable, "-m", "django", "outbox_stats", "--top", "0"]
    calm, lagging = (
        subprocess.run(
            [*command, "--fail-if-lag-above", limit],
            env=subprocess_env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        for limit in ("600", "60")
    )
    assert calm.returncode == 0, calm.stderr
    assert lagging.returncode == 2, lagging.stderr
    assert b"queue_depth            1" in lagging.stdout
    assert b"above --fail-if-lag-above=60" in lagging.stderr


def test_session_names_match_the_relay() -> None:
    """The application names the stats look for are the ones the relay's connections set."""
    from outbox_notify.relay.config import CLAIM_APPLICATION_NAME, LISTEN_APPLICATION_NAME

    query = stats.queries()["relay_sessions"]
    assert f"'{LISTEN_APPLICATION_NAME}'" in query
    assert f"'{CLAIM_APPLICATION_NAME}'" in query


@pytest.mark.django_db(transaction=True)
def test_dead_rows_and_the_snapshot_holding_them_are_reported() -> None:
    """With a session left in a REPEATABLE READ transaction, deleted rows stay dead, and
    outbox_stats names that session as the oldest snapshot (this role sees every session)."""
    # transaction=True: the rows must be committed and deleted by other sessions.
    with connect("tests.old-snapshot", autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        with connect() as writer:
            writer.execute(
                "INSERT INTO outbox_notify_message_v1"
                " (task_id, task_name, args, kwargs, options, schema_version)"
                " SELECT 'dead-' || n, 'tests.add', '[]', '{}', '{}', 1"
                " FROM generate_series(1, 2000) AS n"
            )
            writer.execute("DELETE FROM outbox_notify_message_v1")
        # The writer's session has ended: its statistics reached the collector.
        wait_for(lambda: stats.collect(connections["default"], top=0).dead_rows >= 2000)
        with connect() as vacuum:
            vacuum.execute("VACUUM outbox_notify_message_v1")  # it has to leave them
        wait_for(lambda: stats.collect(connections["default"], top=0).dead_rows_held >= 2000)
        snapshot = stats.collect(connections["default"], top=0)
        holder_pid = holder.info.backend_pid
    assert snapshot.dead_rows_held >= 2000, snapshot
    assert snapshot.oldest_snapshot is not None
    assert (snapshot.oldest_snapshot.kind, snapshot.oldest_snapshot.name) == (
        "session",
        "tests.old-snapshot",
    )
    assert snapshot.oldest_snapshot.pid == holder_pid
    assert (snapshot.oldest_snapshot.seconds or 0) >= 0
    text = stats.format_text(snapshot)
    assert "oldest_snapshot        session pid" in text
    assert f"dead_rows_held         {snapshot.dead_rows_held}" in text
    assert snapshot.as_dict()["oldest_snapshot"]["name"] == "tests.old-snapshot"
    assert snapshot.as_dict()["dead_rows_held"] == snapshot.dead_rows_held
