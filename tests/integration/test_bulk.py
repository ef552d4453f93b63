"""Bulk enqueue against a real PostgreSQL: the same rows as single calls, one COPY per batch."""

from __future__ import annotations

import json
import threading
from typing import Any
from unittest import mock

import psycopg
import pytest
from celery import group
from django.db import DataError, OperationalError, connection, transaction

from outbox_notify import OutboxCelery, bulk
from outbox_notify._write import rows
from outbox_notify.app import RecordingProducer
from outbox_notify.exceptions import SerializationError
from outbox_notify.models import OutboxMessage
from outbox_notify.serialization import OutboxRow
from tests.celery_app import add, app

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True throughout: these tests are about what a commit or a rollback leaves in
# the table, which a test wrapped in one rolled-back transaction could not show.


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every COPY the write side runs (one entry per round trip)."""
    sizes: list[int] = []
    real = rows.insert_rows

    def counting(batch: Any, alias: str, app: Any, **kwargs: Any) -> None:
        sizes.append(len(batch))
        real(batch, alias, app, **kwargs)

    monkeypatch.setattr("outbox_notify._write.batching.insert_rows", counting)
    return sizes


def _options_without(row: OutboxMessage, task_id: str) -> str:
    """The stored options text with the task's own id replaced, for comparing two rows."""
    return json.dumps(row.options, sort_keys=True).replace(task_id, "<id>")


def test_bulk_writes_nothing_until_the_block_ends_then_one_copy_per_batch(
    copies: list[int],
) -> None:
    """Rows appear when the block ends, written in batches of batch_size, one COPY each."""
    with bulk(batch_size=100):
        results = [add.delay(i, i) for i in range(250)]
        assert copies == [100, 100]  # two full batches went out during the block
    assert copies == [100, 100, 50]
    stored = {row.task_id: row.args for row in OutboxMessage.objects.all()}
    assert stored == {r.id: [i, i] for i, r in enumerate(results)}


@pytest.mark.parametrize(
    "send",
    [
        lambda task_id: add.apply_async((1, "a'b\n"), task_id=task_id, priority=3),
        lambda task_id: app.send_task(
            "remote.task", (1.5, None, True), {"k": [1, {"x": "y"}]}, task_id=task_id
        ),
    ],
    ids=["delay", "send_task"],
)
def test_bulk_rows_are_exactly_what_single_calls_store(
    send: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast-path rows equal full-path rows, byte for byte once the task ids are aligned."""
    with transaction.atomic():
        send("single-1")  # Celery builds the message; it becomes the shape's template
    built: list[str] = []
    real_publish = RecordingProducer.publish

    def spy(self: RecordingProducer, body: Any, **kwargs: Any) -> None:
        built.append(kwargs["headers"]["id"])
        real_publish(self, body, **kwargs)

    monkeypatch.setattr(RecordingProducer, "publish", spy)
    with bulk():
        for n in range(3):
            send(f"bulk-{n}")
    assert built == []  # every bulk call reused the template
    by_id = {row.task_id: row for row in OutboxMessage.objects.all()}
    single = by_id["single-1"]
    for n in range(3):
        row = by_id[f"bulk-{n}"]
        assert (row.args, row.kwargs) == (single.args, single.kwargs)
        assert _options_without(row, row.task_id) == _options_without(single, "single-1")


def test_bulk_raises_the_same_serialization_error_and_keeps_the_rest() -> None:
    """A bad argument raises SerializationError at the call; the good calls are written."""
    with bulk():
        add.delay(1, 1)
        add.delay(2, 2)
        with pytest.raises(SerializationError, match="task args"):
            add.delay(object(), 1)
        add.delay(3, 3)
    assert sorted(row.args for row in OutboxMessage.objects.all()) == [[1, 1], [2, 2], [3, 3]]


def test_a_block_that_raises_writes_nothing_even_after_full_batches(copies: list[int]) -> None:
    """Batches written before the exception are rolled back with the block."""
    with pytest.raises(RuntimeError), bulk(batch_size=10):
        for i in range(25):
            add.delay(i, i)
        raise RuntimeError("abandon the import")
    assert copies == [10, 10]
    assert OutboxMessage.objects.count() == 0


def test_bulk_inside_a_transaction_rolls_back_with_it() -> None:
    """A bulk block in an outer atomic() that rolls back leaves nothing either."""
    with pytest.raises(RuntimeError), transaction.atomic():
        with bulk():
            add.delay(1, 1)
        raise RuntimeError("roll back the outer transaction")
    assert OutboxMessage.objects.count() == 0


def test_group_is_one_copy_with_celerys_group_headers(copies: list[int]) -> None:
    """group() writes all its members in one COPY, each with the group id and its index."""
    with transaction.atomic():
        result = group(add.s(i, i) for i in range(5)).apply_async()
    assert copies == [5]
    stored = sorted(OutboxMessage.objects.all(), key=lambda r: r.options["headers"]["group_index"])
    assert [r.task_id for r in stored] == [r.id for r in result.results]
    assert {r.options["headers"]["group"] for r in stored} == {result.id}
    assert [r.options["headers"]["group_index"] for r in stored] == [0, 1, 2, 3, 4]


def test_chunks_and_starmap_go_through_the_bulk_path(copies: list[int]) -> None:
    """chunks() is a group of starmap tasks (one COPY); a starmap in a bulk block is one row."""
    with transaction.atomic():
        add.chunks([(i, i) for i in range(6)], 2).apply_async()
    with bulk():
        add.starmap([(1, 2), (3, 4)]).apply_async()
    assert copies == [3, 1]
    names = sorted(row.task_name for row in OutboxMessage.objects.all())
    assert names == ["celery.starmap"] * 4


def test_group_enqueue_touches_no_result_backend_and_a_rollback_leaves_nothing() -> None:
    """With the result backend down, group() still enqueues; rolled back, nothing remains."""
    down = OutboxCelery("down-backend", set_as_current=False)
    down.conf.update(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/0")

    @down.task(name="tests.down_member")
    def member(x: int) -> int:
        return x

    with transaction.atomic():
        kept = group(member.s(i) for i in range(3)).apply_async()
    with pytest.raises(RuntimeError), transaction.atomic():
        group(member.s(i) for i in range(3)).apply_async()
        raise RuntimeError("roll back")
    assert sorted(row.task_id for row in OutboxMessage.objects.all()) == sorted(
        r.id for r in kept.results
    )
    # Nothing was registered with the backend's result consumer either.
    assert not getattr(down.backend, "_pending_results", ({}, {}))[0]


def test_options_that_differ_per_call_take_celerys_full_path() -> None:
    """countdown in a bulk block still gets an ETA computed for each call."""
    with bulk():
        add.apply_async((1, 1), countdown=60)
        add.apply_async((2, 2), countdown=60)
    etas = [row.options["headers"]["eta"] for row in OutboxMessage.objects.all()]
    assert all(etas)
    assert len(etas) == 2


def test_bulk_results_are_celerys_async_results() -> None:
    """The AsyncResult a bulk call returns has the stored id and the task's result class."""
    with bulk():
        first = add.delay(1, 1)
        second = add.delay(2, 2)
    assert isinstance(second, type(first))
    assert isinstance(second, app.AsyncResult)
    assert {first.id, second.id} == set(OutboxMessage.objects.values_list("task_id", flat=True))


@pytest.fixture(params=[True, False] if rows.BACKGROUND_COPY else [False])
def background(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a full batch is written: on the writer thread (psycopg 3.3 and later) and
    inline, at the call that filled it (psycopg 3.2, or wherever the thread is not used)."""
    monkeypatch.setattr(rows, "BACKGROUND_COPY", request.param)
    return bool(request.param)


def test_the_writer_thread_is_used_only_where_psycopg_keeps_the_connection_locked() -> None:
    """psycopg 3.2's cursor.copy() lets go of the connection's lock once the COPY started."""
    assert rows._copy_holds_the_connection("3.3.0")
    assert rows._copy_holds_the_connection("3.10.1")
    assert not rows._copy_holds_the_connection("3.2.10")
    assert rows.BACKGROUND_COPY is rows._copy_holds_the_connection(psycopg.__version__)


def _bad_row() -> OutboxRow:
    """A row PostgreSQL refuses (its args are not JSON): only the database can fail it."""
    return OutboxRow(
        task_id="bad-row", task_name="t", args="not json", kwargs="{}", options="{}", context="{}"
    )


def test_a_full_batch_is_written_while_the_block_goes_on(background: bool) -> None:
    """A full batch's COPY runs on a writer thread and ends before the block's next query."""
    threads: list[str] = []
    real_copy = psycopg.Cursor.copy

    def recording(cursor: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_copy(cursor, *args, **kwargs)

    with mock.patch.object(psycopg.Cursor, "copy", recording), bulk(batch_size=10):
        results = [add.delay(i, i) for i in range(10)]
        # The query waits for the batch: it sees all ten rows, not a part of them.
        assert OutboxMessage.objects.count() == 10
        results.append(add.delay(10, 10))
    caller = threading.current_thread().name
    assert threads == ["outbox-notify-copy" if background else caller, caller]
    stored = set(OutboxMessage.objects.values_list("task_id", flat=True))
    assert stored == {r.id for r in results}


def test_a_savepoint_rolled_back_after_a_batch_keeps_the_batch(background: bool) -> None:
    """A nested atomic() that rolls back while a batch is being written leaves the batch."""
    with bulk(batch_size=5):
        for i in range(5):
            add.delay(i, i)
        with pytest.raises(RuntimeError), transaction.atomic():
            raise RuntimeError("undo only the savepoint")
    assert OutboxMessage.objects.count() == 5


def test_a_batch_the_database_refuses_raises_at_the_next_query_and_rolls_back(
    background: bool,
) -> None:
    """The COPY's error surfaces at the block's next query (inline: at the call), noted on the
    thread's; nothing is written."""
    with pytest.raises(DataError) as raised, bulk(batch_size=2) as collector:
        collector.add(_bad_row())
        add.delay(1, 1)  # fills the batch: its COPY starts on the writer thread
        OutboxMessage.objects.count()
    if background:
        assert "raised while writing 2 deferred outbox rows" in "".join(raised.value.__notes__)
    assert OutboxMessage.objects.count() == 0


def test_a_refused_batch_raises_when_the_block_ends(background: bool) -> None:
    """With no query after it, the failed COPY raises at the end of the block instead."""
    with pytest.raises(DataError), transaction.atomic():
        with bulk(batch_size=2) as collector:
            collector.add(_bad_row())
            add.delay(1, 1)
        pytest.fail("the block must not end normally")  # pragma: no cover
    assert OutboxMessage.objects.count() == 0


def test_a_refused_batch_undone_by_its_savepoint_leaves_the_outer_transaction_usable(
    background: bool,
) -> None:
    """The block raises while its refused COPY runs: its savepoint undoes it, the rest commits
    (inline, the COPY's own error ends the block the same way)."""
    with transaction.atomic():
        add.delay(0, 0)
        with (
            pytest.raises(RuntimeError if background else DataError),
            bulk(batch_size=2) as collector,
        ):
            collector.add(_bad_row())
            add.delay(1, 1)  # its COPY starts on the writer thread and fails there
            raise RuntimeError("the caller's own error, raised while the COPY runs")
        add.delay(2, 2)
        assert OutboxMessage.objects.count() == 2
    assert sorted(row.args for row in OutboxMessage.objects.all()) == [[0, 0], [2, 2]]


def test_closing_the_connection_while_a_batch_is_written_waits_for_it(background: bool) -> None:
    """connection.close() inside a block lets the running COPY end; the block fails as usual."""
    with pytest.raises(OperationalError, match="the connection is closed"), bulk(batch_size=3):
        for i in range(3):
            add.delay(i, i)
        connection.close()
        add.delay(3, 3)
        OutboxMessage.objects.count()
    assert OutboxMessage.objects.count() == 0
