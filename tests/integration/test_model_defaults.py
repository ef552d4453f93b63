"""The models declare what the database defaults: create() with a user's fields works."""

from __future__ import annotations

import pytest

from outbox_notify.models import SCHEMA_VERSION, DeadLetter, OutboxMessage

pytestmark = pytest.mark.django_db


def test_outbox_message_create_with_only_the_tasks_fields() -> None:
    """OutboxMessage.objects.create() fills schema_version, retries, context, created_at."""
    row = OutboxMessage.objects.create(
        task_id="t-1", task_name="tests.add", args=[1, 2], kwargs={}, options={"headers": {}}
    )
    row.refresh_from_db()
    assert (row.schema_version, row.retries, row.context) == (SCHEMA_VERSION, 0, {})
    assert row.created_at is not None
    assert row.retry_after is None


def test_dead_letter_create_with_only_the_tasks_fields() -> None:
    """DeadLetter.objects.create() fills schema_version, retries, context and both times."""
    dead = DeadLetter.objects.create(
        task_id="t-2",
        task_name="tests.add",
        args=[],
        kwargs={},
        options={"headers": {}},
        failure_reason="requeued by hand",
    )
    dead.refresh_from_db()
    assert (dead.schema_version, dead.retries, dead.context) == (SCHEMA_VERSION, 0, {})
    assert dead.created_at is not None
    assert dead.dead_at is not None
