"""Faults injected into real relays: kills, severed connections, broker outages."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from django.db import connection, transaction
from kombu import Connection, Exchange, Queue

from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add
from tests.integration.test_relay import FAST, enqueue, ready
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relays are other processes and see only committed rows.


def backends(application_name: str) -> list[int]:
    """PIDs of the server backends of relay connections with this application_name."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()",
            [application_name],
        )
        return [row[0] for row in cursor.fetchall()]


def terminate(application_name: str) -> int:
    """pg_terminate_backend every relay connection with this application_name."""
    pids = backends(application_name)
    with connection.cursor() as cursor:
        for pid in pids:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    return len(pids)


def test_sigkill_mid_batch_loses_nothing(start_relay: Any, redis_queue: RedisQueue) -> None:
    """A relay SIGKILLed while publishing: a second relay publishes everything it held."""
    ids = enqueue(redis_queue.name, count=4000)
    victim = start_relay("--batch-size", "500", *FAST)
    wait_for(
        lambda: len(redis_queue.task_ids()) >= 100,
        what="the victim publishing",
        context=victim.output,
    )
    victim.signal(signal.SIGKILL)
    victim.wait()
    survivor = start_relay("--batch-size", "500", *FAST)
    wait_for(
        lambda: not OutboxMessage.objects.exists(),
        what="the backlog drained",
        context=survivor.output,
    )
    assert set(redis_queue.task_ids()) == set(ids)


def test_terminated_listen_connection_reconnects_and_still_wakes(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """pg_terminate_backend on the LISTEN connection: the relay reconnects; commits still publish fast."""
    relay = start_relay("--sweep-interval", "60", "--stale-timeout", "120")
    ready(relay)
    wait_for(lambda: backends("outbox_notify.listen"), what="the LISTEN connection")
    assert terminate("outbox_notify.listen") == 1
    wait_for(
        lambda: relay.output().count("outbox.database_connected") >= 2,
        what="a reconnect",
        context=relay.output,
    )
    time.sleep(0.5)
    [task_id] = enqueue(redis_queue.name)
    wait_for(
        lambda: task_id in redis_queue.task_ids(),
        timeout=10,
        what="a publish after reconnect",
        context=relay.output,
    )


def test_terminated_claim_connection_reconnects(start_relay: Any, redis_queue: RedisQueue) -> None:
    """pg_terminate_backend on the claim connection: the relay reconnects and keeps publishing."""
    relay = start_relay("--sweep-interval", "1")
    ready(relay)
    assert terminate("outbox_notify.claim") == 1
    ids = enqueue(redis_queue.name, count=5)
    wait_for(
        lambda: set(ids) <= set(redis_queue.task_ids()),
        what="publishes after reconnect",
        context=relay.output,
    )
    assert "outbox.database_unavailable" in relay.output()


def test_broker_outage_spends_no_retries(
    start_relay: Any, relay_env: dict[str, Any], private_redis: Any, queue_name: str
) -> None:
    """Broker down: rows wait with retries unspent; broker back: they are published."""
    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=private_redis.url())
    queue = RedisQueue(private_redis.url(), queue_name)
    relay = start_relay("--sweep-interval", "0.5", "--broker-outage-cooldown", "0.5", env=env)
    ready(relay)
    [before] = enqueue(queue_name)
    wait_for(
        lambda: before in queue.task_ids(), what="a publish before the outage", context=relay.output
    )
    private_redis.stop()
    ids = enqueue(queue_name, count=3)
    wait_for(
        lambda: "outbox.breaker_opened" in relay.output(),
        what="the breaker opening",
        context=relay.output,
    )
    time.sleep(2)  # several outage cycles
    assert list(OutboxMessage.objects.values_list("retries", flat=True)) == [0, 0, 0]
    assert not DeadLetter.objects.exists()
    private_redis.start()
    queue = RedisQueue(private_redis.url(), queue_name)
    wait_for(
        lambda: set(ids) <= set(queue.task_ids()),
        what="publishes after the outage",
        context=relay.output,
    )
    wait_for(lambda: "outbox.breaker_closed" in relay.output(), what="the breaker closing")


def test_rabbitmq_publishes_with_confirms(
    start_relay: Any, relay_env: dict[str, Any], amqp_url: str, queue_name: str
) -> None:
    """With RabbitMQ the relay publishes (confirmed) and the message waits in the queue."""
    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)
    relay = start_relay(*FAST, env=env)
    ready(relay)
    with Connection(amqp_url) as conn:
        # Declared as Celery declares a missing queue, so the test can poll it before the
        # relay's own declaration.
        queue = Queue(queue_name, Exchange(queue_name), routing_key=queue_name)
        queue(conn.default_channel).declare()
        with transaction.atomic():
            task_id = add.apply_async((4, 5), queue=queue_name, headers={"x-k": "v"}, priority=3).id
        try:

            def fetch() -> Any:
                return queue(conn.default_channel).get(no_ack=True)

            message = wait_for(fetch, what="the message in RabbitMQ", context=relay.output)
            assert message.headers["id"] == task_id
            assert message.headers["x-k"] == "v"
            assert message.properties["priority"] == 3
        finally:
            queue(conn.default_channel).delete()
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted")


def test_rabbitmq_channel_error_is_an_ordinary_failure(
    start_relay: Any, relay_env: dict[str, Any], amqp_url: str, queue_name: str
) -> None:
    """Publishing to an exchange that does not exist fails that message only; it dead-letters."""
    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)
    relay = start_relay("--max-retries", "1", *FAST, env=env)
    ready(relay)
    missing = Exchange(f"missing-{queue_name}", type="direct", no_declare=True)
    with Connection(amqp_url) as conn:
        Queue(queue_name, Exchange(queue_name), routing_key=queue_name)(
            conn.default_channel
        ).declare()
    with transaction.atomic():
        bad = add.apply_async((1, 1), exchange=missing, routing_key="nowhere").id
        good = add.apply_async((2, 2), queue=queue_name).id
    dead = wait_for(
        lambda: DeadLetter.objects.filter(task_id=bad).first(),
        what="the dead letter",
        context=relay.output,
    )
    assert "NOT_FOUND" in dead.failure_reason or "404" in dead.failure_reason
    with Connection(amqp_url) as conn:
        queue = Queue(queue_name, Exchange(queue_name), routing_key=queue_name)
        try:
            message = wait_for(
                lambda: queue(conn.default_channel).get(no_ack=True), what="the good message"
            )
            assert message.headers["id"] == good
        finally:
            queue(conn.default_channel).delete()


def test_redis_refusing_writes_is_an_outage_not_a_failure(
    start_relay: Any, relay_env: dict[str, Any], private_redis: Any, queue_name: str
) -> None:
    """Redis out of memory refuses every write: no retry is spent, nothing is dead-lettered."""
    import redis

    env = dict(relay_env, OUTBOX_TEST_BROKER_URL=private_redis.url())
    client = redis.Redis.from_url(private_redis.url())
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    relay = start_relay(
        "--sweep-interval", "0.5", "--broker-outage-cooldown", "0.5", "--max-retries", "1", env=env
    )
    ids = enqueue(queue_name, count=3)
    wait_for(
        lambda: "outbox.breaker_opened" in relay.output(),
        what="the breaker opening",
        context=relay.output,
    )
    assert "OutOfMemoryError" in relay.output() or "maxmemory" in relay.output()
    assert list(OutboxMessage.objects.values_list("retries", flat=True)) == [0, 0, 0]
    assert not DeadLetter.objects.exists()
    client.config_set("maxmemory", 0)
    queue = RedisQueue(private_redis.url(), queue_name)
    wait_for(
        lambda: set(ids) <= set(queue.task_ids()),
        what="publishes after memory frees",
        context=relay.output,
    )
