"""The write side against a real PostgreSQL: rows appear with the transaction, and only then."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pytest
import structlog
from celery import chain, chord, group
from django.db import connections, transaction
from django.test import override_settings

from outbox_notify import OutboxCelery, compact
from outbox_notify.exceptions import SerializationError
from outbox_notify.models import OutboxMessage
from outbox_notify.serialization import COMPACT_VERSION, PublishSpec
from tests.celery_app import add, app

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])
# transaction=True throughout: these tests are about what a commit or a rollback leaves in
# the table, which a test wrapped in one rolled-back transaction could not show.


def _options(row: OutboxMessage) -> dict[str, Any]:
    return dict(row.options)


def _spec(row: OutboxMessage) -> PublishSpec:
    """The message a relay publishes for the row (its stored options decoded)."""
    return compact.decode_any(
        row.options, task_id=row.task_id, task_name=row.task_name, schema_version=row.schema_version
    )


def test_delay_inside_atomic_writes_one_row_committed_with_the_transaction() -> None:
    """delay() in atomic() writes one row, visible to others only after the commit."""
    with transaction.atomic():
        result = add.delay(2, 3)
        assert OutboxMessage.objects.count() == 1
    row = OutboxMessage.objects.get()
    assert row.task_id == result.id
    assert row.task_name == "tests.add"
    assert row.args == [2, 3]
    assert row.kwargs == {}
    assert row.schema_version == COMPACT_VERSION
    assert row.retries == 0
    assert row.retry_after is None
    assert _spec(row).headers["id"] == result.id


def test_rollback_leaves_nothing() -> None:
    """A rolled-back transaction leaves no outbox row."""
    with pytest.raises(RuntimeError), transaction.atomic():
        add.delay(1, 1)
        raise RuntimeError("roll back")
    assert OutboxMessage.objects.count() == 0


def test_outside_atomic_commits_at_once_and_logs_a_warning() -> None:
    """Outside atomic() the row is autocommitted and a warning event is logged."""
    with structlog.testing.capture_logs() as logs:
        result = add.delay(1, 2)
    assert OutboxMessage.objects.filter(task_id=result.id).exists()
    events = [e for e in logs if e["event"] == "outbox.enqueue_outside_transaction"]
    assert len(events) == 1
    assert events[0]["log_level"] == "warning"
    assert events[0]["task_id"] == result.id


def test_unserializable_args_raise_before_writing_and_transaction_stays_usable() -> None:
    """SerializationError at the call; nothing written; the caller's transaction goes on."""
    with transaction.atomic():
        add.delay(1, 1)
        with pytest.raises(SerializationError) as excinfo:
            add.delay(object(), 1)
        assert isinstance(excinfo.value, TypeError)
        add.delay(2, 2)
    assert [row.args for row in OutboxMessage.objects.order_by("id")] == [[1, 1], [2, 2]]


def test_nul_bytes_and_unicode_survive_storage() -> None:
    """Strings with NUL bytes and non-ASCII text are stored exactly (json, not jsonb)."""
    with transaction.atomic():
        add.delay("a\x00b", "ünïcødé ✓")
    assert OutboxMessage.objects.get().args == ["a\x00b", "ünïcødé ✓"]


def test_send_task_returns_result_with_given_task_id() -> None:
    """send_task with an explicit task_id stores and returns that id."""
    task_id = str(uuid.uuid4())
    with transaction.atomic():
        result = app.send_task("remote.task", args=[1], kwargs={"k": "v"}, task_id=task_id)
    assert result.id == task_id
    row = OutboxMessage.objects.get()
    assert (row.task_id, row.task_name, row.kwargs) == (task_id, "remote.task", {"k": "v"})


@override_settings(OUTBOX_NOTIFY_DATABASE="other")
def test_rows_go_to_the_configured_alias_and_its_transaction() -> None:
    """With OUTBOX_NOTIFY_DATABASE set, rows follow that alias's transaction, not default's."""
    with transaction.atomic(using="other"):
        add.delay(5, 5)
    with pytest.raises(RuntimeError), transaction.atomic(using="other"):
        add.delay(6, 6)
        raise RuntimeError("roll back other")
    assert OutboxMessage.objects.using("other").count() == 1
    assert OutboxMessage.objects.using("default").count() == 0


def test_options_are_recorded_as_celery_would_send_them() -> None:
    """countdown, expires (timedelta), priority, queue, headers... land in the stored message."""
    with transaction.atomic():
        add.apply_async(
            (1, 2),
            countdown=30,
            expires=dt.timedelta(minutes=5),
            priority=7,
            queue="q-custom",
            headers={"x-tenant": "acme"},
            time_limit=10,
            soft_time_limit=5,
            shadow="add-shadow",
            ignore_result=True,
        )
    row = OutboxMessage.objects.get()
    spec = _spec(row)
    headers = spec.headers
    assert headers["x-tenant"] == "acme"
    assert headers["timelimit"] == [10, 5]
    assert headers["shadow"] == "add-shadow"
    assert headers["ignore_result"] is True
    eta = dt.datetime.fromisoformat(headers["eta"])
    expires = dt.datetime.fromisoformat(headers["expires"])
    assert 290 <= (expires - eta).total_seconds() + 30 <= 310
    assert spec.properties["priority"] == 7
    assert spec.routing_key == "q-custom"
    assert _options(row)["relative"] == {"countdown": 30.0, "expires": 300.0}


def test_canvas_writes_one_row_per_message_sent_now() -> None:
    """chain() writes its first task (the rest embedded); group() writes one row per member."""
    with transaction.atomic():
        chain(add.s(1, 1), add.s(2)).apply_async()
        group(add.s(1, 2), add.s(3, 4)).apply_async()
    rows = list(OutboxMessage.objects.order_by("id"))
    assert len(rows) == 3
    assert rows[0].options["embed"]["chain"]
    group_ids = {row.options["headers"]["group"] for row in rows[1:]}
    assert len(group_ids) == 1
    assert None not in group_ids


def test_chord_header_rows_carry_the_chord_callback(redis_url: str) -> None:
    """chord() writes its header tasks with the body embedded as the chord callback."""
    # Chords need a result backend, and Celery sets the chord's counter in it when the chord
    # is applied (documented: chords touch the result backend at enqueue). The broker is a
    # port nothing listens on: enqueueing must not need it.
    chord_app = OutboxCelery("chords", set_as_current=False)
    chord_app.conf.update(broker_url="redis://127.0.0.1:1/0", result_backend=redis_url)

    @chord_app.task(name="tests.mul")
    def mul(x: int, y: int) -> int:
        return x * y

    with transaction.atomic():
        chord([mul.s(1, 1), mul.s(2, 2)])(mul.s(10))
    rows = list(OutboxMessage.objects.order_by("id"))
    assert len(rows) == 2
    assert all(row.options["embed"]["chord"]["task"] == "tests.mul" for row in rows)


def test_a_result_backend_is_not_contacted_at_enqueue() -> None:
    """delay() with a Redis result backend that is down still writes the row."""
    down_app = OutboxCelery("down", set_as_current=False)
    down_app.conf.update(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/0")

    @down_app.task(name="tests.down")
    def down(x: int) -> int:
        return x

    with transaction.atomic():
        result = down.delay(1)
    assert OutboxMessage.objects.get().task_id == result.id


def test_structlog_context_is_captured_and_filtered() -> None:
    """Bound structlog contextvars are stored; OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS filters."""
    structlog.contextvars.bind_contextvars(request_id="r-1", user="u-9")
    try:
        with transaction.atomic():
            add.delay(1, 1)
        with (
            override_settings(OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS=["request_id"]),
            transaction.atomic(),
        ):
            add.delay(2, 2)
        with override_settings(OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS=()), transaction.atomic():
            add.delay(3, 3)
    finally:
        structlog.contextvars.clear_contextvars()
    contexts = [row.context for row in OutboxMessage.objects.order_by("id")]
    assert contexts[0]["structlog"] == {"request_id": "r-1", "user": "u-9"}
    assert contexts[1]["structlog"] == {"request_id": "r-1"}
    assert "structlog" not in contexts[2]


def test_created_signal_fires_after_commit_only() -> None:
    """outbox_message_created is sent after the commit, never for a rolled-back row."""
    from outbox_notify.signals import outbox_message_created

    seen: list[str] = []

    def receiver(sender: Any, task_id: str, task_name: str, **kwargs: Any) -> None:
        seen.append(task_id)

    outbox_message_created.connect(receiver)
    try:
        with transaction.atomic():
            kept = add.delay(1, 1)
            assert seen == []
        with pytest.raises(RuntimeError), transaction.atomic():
            add.delay(2, 2)
            raise RuntimeError("roll back")
    finally:
        outbox_message_created.disconnect(receiver)
    assert seen == [kept.id]


def test_stored_text_is_kombu_json() -> None:
    """args are stored as kombu's JSON text, so datetimes keep their type tag for the worker."""
    moment = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    with transaction.atomic():
        add.delay(moment, 1)
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT args::text FROM outbox_notify_message_v1")
        (text,) = cursor.fetchone()
    assert json.loads(text)[0] == {"__type__": "datetime", "__value__": moment.isoformat()}


def test_tasks_a_worker_task_enqueues_do_not_warn() -> None:
    """Enqueueing from a task that a worker runs is autocommit by design: no warning."""
    worker_app = OutboxCelery("worker-side", set_as_current=False)
    worker_app.conf.update(broker_url="redis://127.0.0.1:1/0")

    @worker_app.task(name="tests.child")
    def child(x: int) -> int:
        return x

    @worker_app.task(name="tests.parent")
    def parent(x: int) -> str:
        return child.delay(x).id  # type: ignore[no-any-return]

    with structlog.testing.capture_logs() as logs:
        # apply() runs the task through Celery's tracer, as a worker does.
        child_id = parent.apply((7,)).get()
        outside = child.delay(8)
    warned = [e["task_id"] for e in logs if e["event"] == "outbox.enqueue_outside_transaction"]
    assert warned == [outside.id]
    assert OutboxMessage.objects.filter(task_id=child_id).exists()
