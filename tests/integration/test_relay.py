"""The relay as a real subprocess, against a real PostgreSQL and a real Redis."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from django.db import transaction

from outbox_notify.models import OutboxMessage
from tests.celery_app import add
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay runs in another process and sees only committed rows.

FAST = ["--sweep-interval", "1", "--backoff-time", "0.2", "--max-backoff", "1"]


def _ready(relay: Any) -> None:
    wait_for(
        lambda: "outbox.database_connected" in relay.output(),
        what="relay start",
        context=relay.output,
    )


def test_commit_is_published_and_row_deleted(start_relay: Any, redis_queue: RedisQueue) -> None:
    """A committed task reaches the broker with its task id, and the row is deleted."""
    relay = start_relay(*FAST)
    _ready(relay)
    with transaction.atomic():
        result = add.apply_async((2, 3), queue=redis_queue.name)
    wait_for(lambda: result.id in redis_queue.task_ids(), what="the message in Redis")
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted")
    [message] = redis_queue.messages()
    assert message["headers"]["task"] == "tests.add"
    assert message["body"][0] == [2, 3]


def test_rollback_is_never_published(start_relay: Any, redis_queue: RedisQueue) -> None:
    """A rolled-back delay() never reaches the broker; a later commit does."""
    relay = start_relay(*FAST)
    _ready(relay)
    with pytest.raises(RuntimeError), transaction.atomic():
        add.apply_async((1, 1), queue=redis_queue.name)
        raise RuntimeError("roll back")
    with transaction.atomic():
        kept = add.apply_async((9, 9), queue=redis_queue.name)
    wait_for(lambda: kept.id in redis_queue.task_ids(), what="the committed message")
    assert redis_queue.task_ids() == [kept.id]


def test_sigterm_exits_zero(start_relay: Any, redis_queue: RedisQueue) -> None:
    """SIGTERM makes an idle relay exit 0 promptly."""
    relay = start_relay(*FAST)
    _ready(relay)
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0
    assert "outbox.relay_stopped" in relay.output()
