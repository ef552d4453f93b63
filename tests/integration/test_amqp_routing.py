"""Routing on RabbitMQ through a real relay: quorum queues, topic and fanout exchanges, priorities."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import amqp
import pytest
from django.db import transaction
from kombu import Exchange

from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add, record
from tests.integration.test_relay import FAST, ready
from tests.relay_support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.rabbitmq]
# transaction=True: the relay and the worker are other processes and see only committed rows.


@pytest.fixture
def rabbit(amqp_url: str) -> Iterator[tuple[amqp.Channel, list[tuple[str, str]]]]:
    """A channel on the shared RabbitMQ; queues and exchanges listed in it are deleted after."""
    host = amqp_url.split("@", 1)[1].rstrip("/")
    conn = amqp.Connection(host, userid="guest", password="guest")
    conn.connect()
    created: list[tuple[str, str]] = []
    try:
        yield conn.channel(), created
    finally:
        channel = conn.channel()
        for kind, name in created:
            if kind == "queue":
                channel.queue_delete(name)
            else:
                channel.exchange_delete(name)
        conn.close()


def _take(channel: amqp.Channel, queue: str) -> amqp.Message | None:
    return channel.basic_get(queue, no_ack=True)


@pytest.fixture
def amqp_relay(start_relay: Any, relay_env: dict[str, Any], amqp_url: str) -> Any:
    """A relay publishing to the shared RabbitMQ."""
    relay = start_relay(*FAST, env=dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url))
    ready(relay)
    return relay


def test_quorum_queue_behind_a_topic_exchange_gets_the_message_as_celery_sent_it(
    rabbit: tuple[amqp.Channel, list[tuple[str, str]]], amqp_relay: Any, queue_name: str
) -> None:
    """x-queue-type quorum, a topic binding with a wildcard, headers and priority all hold."""
    channel, created = rabbit
    exchange = f"{queue_name}-topic"
    channel.queue_declare(
        queue_name, durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
    )
    channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
    channel.queue_bind(queue_name, exchange, "orders.#")
    created += [("queue", queue_name), ("exchange", exchange), ("queue", f"{queue_name}-decl")]
    with transaction.atomic():
        task_id = add.apply_async(
            (2, 3),
            queue=f"{queue_name}-decl",
            exchange=Exchange(exchange, type="topic", no_declare=True),
            routing_key="orders.eu.new",
            priority=4,
            headers={"x-tenant": "acme"},
        ).id
    message = wait_for(
        lambda: _take(channel, queue_name), what="the message", context=amqp_relay.output
    )
    assert message.properties["application_headers"]["id"] == task_id
    assert message.properties["application_headers"]["x-tenant"] == "acme"
    assert message.properties["priority"] == 4
    assert message.properties["delivery_mode"] == 2
    assert message.delivery_info["routing_key"] == "orders.eu.new"
    assert json.loads(message.body)[0] == [2, 3]
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted")


def test_fanout_exchange_reaches_every_bound_queue(
    rabbit: tuple[amqp.Channel, list[tuple[str, str]]], amqp_relay: Any, queue_name: str
) -> None:
    """One publish to a fanout exchange lands in each queue bound to it."""
    channel, created = rabbit
    exchange, first, second = f"{queue_name}-fan", f"{queue_name}-a", f"{queue_name}-b"
    channel.exchange_declare(exchange, "fanout", durable=True, auto_delete=False)
    for queue in (first, second):
        channel.queue_declare(queue, durable=True, auto_delete=False)
        channel.queue_bind(queue, exchange, "")
    created += [("queue", first), ("queue", second), ("exchange", exchange)]
    created.append(("queue", f"{queue_name}-decl"))
    with transaction.atomic():
        task_id = add.apply_async(
            (1, 1),
            queue=f"{queue_name}-decl",
            exchange=Exchange(exchange, type="fanout", no_declare=True),
            routing_key="ignored",
        ).id
    for queue in (first, second):
        message = wait_for(
            lambda q=queue: _take(channel, q),
            what=f"the copy in {queue}",
            context=amqp_relay.output,
        )
        assert message.properties["application_headers"]["id"] == task_id
    assert not DeadLetter.objects.exists()


@pytest.fixture
def amqp_env(relay_env: dict[str, Any], amqp_url: str) -> dict[str, Any]:
    """Environment for relays and workers on the shared RabbitMQ."""
    return dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)


def test_a_worker_runs_a_task_routed_by_topic_with_a_priority(
    rabbit: tuple[amqp.Channel, list[tuple[str, str]]],
    start_relay: Any,
    start_worker: Any,
    amqp_env: dict[str, Any],
    queue_name: str,
) -> None:
    """A real Celery worker consuming the bound queue executes the task with its options."""
    channel, created = rabbit
    env = amqp_env
    record_file = Path(start_worker(queue_name, env))
    created += [("queue", queue_name), ("exchange", queue_name)]
    wait_for(lambda: _queue_exists(channel, queue_name), what="the worker's queue", timeout=60)
    exchange = f"{queue_name}-topic"
    channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
    channel.queue_bind(queue_name, exchange, "jobs.*")
    created.append(("exchange", exchange))
    relay = start_relay(*FAST, env=env)
    ready(relay)
    with transaction.atomic():
        task_id = record.apply_async(
            ("routed",),
            queue=queue_name,
            exchange=Exchange(exchange, type="topic", no_declare=True),
            routing_key="jobs.urgent",
            priority=7,
        ).id
    entry = wait_for(
        lambda: _executed(record_file, task_id), what="the execution", context=relay.output
    )
    assert entry["args"] == ["routed"]
    assert entry["delivery_info"]["routing_key"] == "jobs.urgent"
    assert entry["delivery_info"]["priority"] == 7


def _queue_exists(channel: amqp.Channel, name: str) -> bool:
    try:
        channel.queue_declare(name, passive=True)
    except amqp.exceptions.NotFound:
        return False
    return True


def _executed(path: Path, task_id: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        entry: dict[str, Any] = json.loads(line)
        if entry["id"] == task_id:
            return entry
    return None
