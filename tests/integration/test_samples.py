"""The relay's dashboard samples in a real PostgreSQL: one row per write, the queue's counts,
a day kept."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection

from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.samples import SampleRecorder
from outbox_notify.relay.store import ClaimStore

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the store has its own connection and commits its rows.

INSERT = (
    "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
    " schema_version, retries, last_error, retry_after)"
    " VALUES (%s, 't', '[]', '{}', '{}', 1, %s, %s, now() + interval '1 hour')"
)
SAMPLES = "SELECT relay, pid, mode, published, held, retrying, dead_letters, dead_by_task"
SAMPLES += " FROM outbox_notify_sample_v1 ORDER BY at"


@pytest.fixture
def store() -> Iterator[ClaimStore]:
    """A connected ClaimStore on the test database, and no samples (the table has no model:
    Django's flush between tests leaves it alone)."""
    rows("DELETE FROM outbox_notify_sample_v1 RETURNING 1")
    claim_store = ClaimStore(connection_kwargs("default"), stale_timeout=30.0)
    claim_store.connect()
    yield claim_store
    claim_store.close()
    rows("DELETE FROM outbox_notify_sample_v1 RETURNING 1")


def rows(query: str) -> list[tuple[object, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(query)
        return list(cursor.fetchall())


def test_a_sample_counts_held_and_retrying_rows_beside_the_relays_figures(
    store: ClaimStore,
) -> None:
    """held: never tried, ETA ahead; retrying: failed, not due yet; the relay's own counts."""
    with connection.cursor() as cursor:
        cursor.execute(INSERT, ["held", 0, None])
        cursor.execute(INSERT, ["retrying", 2, "boom"])
    recorder = SampleRecorder(store, now=0.0)
    recorder.published = 7
    recorder.dead_by_task.update({"tasks.bad": 2})
    recorder.write(60.0, depth=2, polling=False)
    [(relay, pid, mode, published, held, retrying, dead, by_task)] = rows(SAMPLES)
    assert (relay, pid, mode) == (recorder.relay, recorder.pid, "listen")
    assert (published, held, retrying, dead) == (7, 1, 1, 0)
    assert by_task == {"tasks.bad": 2}


def test_writing_a_sample_deletes_the_ones_older_than_a_day(store: ClaimStore) -> None:
    """Retention is part of the write: a row of yesterday goes when today's arrives."""
    recorder = SampleRecorder(store, now=0.0)
    recorder.write(60.0, depth=0, polling=True)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE outbox_notify_sample_v1 SET at = now() - interval '25 hours'")
    recorder.write(120.0, depth=0, polling=True)
    assert len(rows(SAMPLES)) == 1
    assert rows(
        "SELECT count(*) FROM outbox_notify_sample_v1 WHERE at > now() - interval '1 minute'"
    ) == [(1,)]
