"""The claim store's gauges and row ages against a real PostgreSQL: the outbox table only,
the database's clock, and failures that never cost the connection."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection

from outbox_notify import stats
from outbox_notify.exceptions import GaugeUnavailable
from outbox_notify.relay import store as store_module
from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.store import ClaimStore, Outcome

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the store has its own connection and sees only committed rows.

INSERT_AGED = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
    " schema_version, created_at)"
    " SELECT 'g-' || n, 'tests.add', '[]', '{}', '{}', 1, now() - make_interval(secs => %s)"
    " FROM generate_series(1, %s) AS n"
)


@pytest.fixture
def store() -> Iterator[ClaimStore]:
    """A connected ClaimStore on the test database."""
    claim_store = ClaimStore(connection_kwargs("default"), stale_timeout=30.0)
    claim_store.connect()
    yield claim_store
    claim_store.close()


def insert_aged(rows: int, age_seconds: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(INSERT_AGED, [age_seconds, rows])


def test_gauges_count_rows_and_age_the_oldest_on_the_database_clock(store: ClaimStore) -> None:
    """Depth is exact under the cap; the oldest age comes from created_at and the server's now."""
    assert store.queue_gauges().depth == 0
    insert_aged(3, 3600.0)
    gauges = store.queue_gauges()
    assert gauges.depth == 3
    assert 3600.0 <= gauges.oldest_seconds < 3600.0 + 60


def test_gauges_estimate_beyond_the_cap(store: ClaimStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GAUGE_EXACT_LIMIT rows the depth is the planner's way of estimating, not a count."""
    monkeypatch.setattr(store_module, "GAUGE_EXACT_LIMIT", 10)
    insert_aged(500, 1.0)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE outbox_notify_message_v1")
    depth = store.queue_gauges().depth
    assert 250 <= depth <= 1000, depth  # an estimate, of the right size


def test_a_failing_gauge_query_leaves_the_connection_usable(store: ClaimStore) -> None:
    """A gauge that fails while the connection is fine raises GaugeUnavailable, and the next
    claim works on the same connection."""
    insert_aged(1, 1.0)
    assert store.conn is not None
    store.conn.execute("SET lock_timeout = '50ms'")
    store.conn.commit()
    with psycopg.connect(**connection_kwargs("default")) as blocker:
        blocker.execute("LOCK TABLE outbox_notify_message_v1 IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(GaugeUnavailable, match="lock timeout"):
            store.queue_gauges()
        blocker.rollback()
    with store.claim(10) as claim:
        assert [r.task_id for r in claim.rows] == ["g-1"]
        claim.finish(Outcome(published=[claim.rows[0].id]))
    assert store.queue_gauges().depth == 0


def test_claimed_rows_carry_their_age_on_the_database_clock(store: ClaimStore) -> None:
    """Each claimed row's `age` is now() - created_at as the server sees it (for the lag)."""
    insert_aged(1, 120.0)
    with store.claim(10) as claim:
        [row] = claim.rows
    assert 120.0 <= row.age < 120.0 + 60


def insert_held(task_id: str, created_ago: float, due_in: float) -> None:
    """A row held until its ETA (retry_after set, never tried), written `created_ago` s ago."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version, created_at, retry_after) VALUES (%s, 'tests.add', '[]', '{}', '{}',"
            " 1, now() - make_interval(secs => %s), now() + make_interval(secs => %s))",
            [task_id, created_ago, due_in],
        )


def test_the_oldest_gauge_agrees_with_outbox_stats_about_held_rows(store: ClaimStore) -> None:
    """A row held for tomorrow is not pending; one whose ETA passed is, from its ETA on."""
    insert_held("tomorrow", created_ago=7200.0, due_in=86400.0)
    insert_held("was-due", created_ago=3600.0, due_in=-600.0)
    insert_aged(1, 60.0)
    gauges = store.queue_gauges()
    snapshot = stats.collect(connection, top=0)
    assert gauges.depth == snapshot.queue_depth == 3
    assert 600.0 <= gauges.oldest_seconds < 600.0 + 60  # from the ETA, not created_at
    assert gauges.oldest_seconds == pytest.approx(snapshot.oldest_pending_seconds, abs=5)


def test_a_claimed_held_row_ages_from_its_eta(store: ClaimStore) -> None:
    """The lag of a held row counts from when it became publishable (its ETA)."""
    insert_held("was-due", created_ago=3600.0, due_in=-120.0)
    with store.claim(10) as claim:
        [row] = claim.rows
    assert 120.0 <= row.age < 120.0 + 60
