"""A message whose own send breaks the Redis connection is found and failed; nothing else is."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from django.db import transaction

from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay is another process and sees only committed rows.


def test_a_batch_broken_by_one_huge_message_is_split_until_the_culprit_is_alone(
    start_relay: Any, relay_env: dict[str, Any], private_redis: Any, queue_name: str
) -> None:
    """Redis closes the connection on a bulk over proto-max-bulk-len: the rest still arrive."""
    client = redis.Redis.from_url(private_redis.url())
    client.config_set("proto-max-bulk-len", 1024 * 1024)
    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=private_redis.url())
    with transaction.atomic():
        before = [add.apply_async((n, n), queue=queue_name).id for n in range(20)]
        huge = add.apply_async(("x" * (1024 * 1024 + 1), 0), queue=queue_name).id
        after = [add.apply_async((n, n), queue=queue_name).id for n in range(20)]
    relay = start_relay(
        "--max-retries",
        "2",
        "--sweep-interval",
        "0.5",
        "--broker-outage-cooldown",
        "0.2",
        "--backoff-time",
        "0.2",
        "--max-backoff",
        "0.5",
        env=env,
    )
    queue = RedisQueue(private_redis.url(), queue_name)
    wait_for(
        lambda: set(before + after) <= set(queue.task_ids()),
        what="every other message",
        context=relay.output,
    )
    dead = wait_for(
        lambda: DeadLetter.objects.filter(task_id=huge).first(),
        what="the huge message dead-lettered",
        context=relay.output,
    )
    assert "broke each time this message was sent" in dead.failure_reason
    assert not OutboxMessage.objects.exists()
    assert DeadLetter.objects.count() == 1


def test_redis_stopped_mid_flow_blames_nothing(
    start_relay: Any, relay_env: dict[str, Any], private_redis: Any, queue_name: str
) -> None:
    """Redis killed and restarted under a flow of batches: no retry is spent, nothing dies."""
    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=private_redis.url())
    relay = start_relay(
        "--max-retries", "1", "--sweep-interval", "0.5", "--broker-outage-cooldown", "0.2", env=env
    )
    for round_ in range(3):
        with transaction.atomic():
            for n in range(300):
                add.apply_async((n, round_), queue=queue_name)
        private_redis.stop()
        private_redis.start()
    # A restarted private Redis keeps nothing, so what went out before a restart is gone
    # from it; the rows tell what the relay did with each message.
    wait_for(
        lambda: not OutboxMessage.objects.exists(), what="every row published", context=relay.output
    )
    assert not DeadLetter.objects.exists()
    with transaction.atomic():
        last = [add.apply_async((n, 9), queue=queue_name).id for n in range(20)]
    queue = RedisQueue(private_redis.url(), queue_name)
    wait_for(
        lambda: set(last) <= set(queue.task_ids()), what="later messages", context=relay.output
    )
