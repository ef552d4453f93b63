"""RabbitMQ back-pressure and faults against a real relay: outages, never failures.

Each test runs a relay subprocess against a private RabbitMQ node (devtools/rabbitserver.py)
that it alarms, force-closes, fills or restarts; the machine's shared broker is never touched.
"""

from __future__ import annotations

import time
from typing import Any

import amqp
import celery
import pytest
from kombu import Exchange

from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.models import DeadLetter, OutboxMessage
from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.publisher import KombuPublisher
from tests.integration.test_relay import enqueue, ready
from tests.relay_support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.rabbitmq]
# transaction=True: the relay is another process and sees only committed rows.

QUICK = ["--sweep-interval", "0.5", "--broker-outage-cooldown", "0.5", "--backoff-time", "0.2"]
# Batches of 4: every fault finds two batches in flight (one awaiting its confirms while the
# next is claimed and written), the relay's usual state under load on RabbitMQ.
SMALL = ["--batch-size", "4"]


class RabbitQueue:
    """Reads (and removes) the Celery messages that reach one queue of a RabbitMQ node."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.ids: list[str] = []

    def _channel(self) -> tuple[amqp.Connection, amqp.Channel]:
        host = self.url.split("@", 1)[1].rstrip("/")
        conn = amqp.Connection(host, userid="guest", password="guest", connect_timeout=5)
        conn.connect()
        return conn, conn.channel()

    def declare(self, **arguments: Any) -> None:
        """Declare the queue as Celery would (durable), with extra x-arguments."""
        conn, channel = self._channel()
        try:
            channel.queue_declare(self.name, durable=True, auto_delete=False, arguments=arguments)
        finally:
            conn.close()

    def take(self, limit: int = 100_000) -> list[str]:
        """Consume up to `limit` waiting messages; every task id seen so far."""
        conn, channel = self._channel()
        try:
            for _ in range(limit):
                message = channel.basic_get(self.name, no_ack=True)
                if message is None:
                    break
                self.ids.append(message.properties["application_headers"]["id"])
        finally:
            conn.close()
        return self.ids

    def has_all(self, ids: list[str]) -> bool:
        """Whether every id has arrived (consuming what waits)."""
        return set(ids) <= set(self.take())


@pytest.fixture
def rabbit_env(relay_env: dict[str, Any], private_rabbit: Any) -> dict[str, Any]:
    """Relay environment publishing to the private node."""
    return dict(relay_env, OUTBOX_TEST_BROKER_URL=private_rabbit.url())


def _unspent() -> None:
    assert not DeadLetter.objects.exists()
    assert set(OutboxMessage.objects.values_list("retries", flat=True)) <= {0}


def test_memory_alarm_spends_no_retry_and_everything_arrives_after(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """A memory alarm blocks publishers: with --send-timeout 1 --max-retries 2 nothing dies."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    queue.declare()
    relay = start_relay("--send-timeout", "1", "--max-retries", "2", *QUICK, *SMALL, env=rabbit_env)
    ready(relay)
    before = enqueue(queue_name, count=5)
    wait_for(lambda: queue.has_all(before), what="publishes before the alarm", context=relay.output)
    private_rabbit.memory_alarm(True)
    during = enqueue(queue_name, count=50)
    wait_for(
        lambda: "outbox.breaker_opened" in relay.output(),
        what="the breaker opening",
        context=relay.output,
    )
    time.sleep(4)  # many send timeouts' worth of blocked publishing
    _unspent()
    assert OutboxMessage.objects.count() == 50
    private_rabbit.memory_alarm(False)
    wait_for(lambda: queue.has_all(during), what="publishes after the alarm", context=relay.output)
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the rows deleted")
    assert not DeadLetter.objects.exists()
    assert "RabbitMQ blocks publishing" in relay.output()


def test_queue_at_its_length_limit_rejecting_publishes_is_an_outage(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """x-overflow reject-publish nacks: no retry is spent, the rest goes out once there is room."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    # Celery's declaration of the queue (no arguments) would be refused as inequivalent, so
    # the tasks go through a named exchange bound to it (Celery declares another queue).
    queue.declare(**{"x-max-length": 3, "x-overflow": "reject-publish"})
    _bind(private_rabbit.url(), queue_name)
    relay = start_relay("--max-retries", "1", *QUICK, *SMALL, env=rabbit_env)
    ready(relay)
    exchange = Exchange(f"{queue_name}-x", type="direct", no_declare=True)
    ids = enqueue(f"{queue_name}-other", count=8, exchange=exchange, routing_key="work")
    wait_for(
        lambda: "basic.nack" in relay.output(), what="a rejected publish", context=relay.output
    )
    time.sleep(2)
    _unspent()
    assert OutboxMessage.objects.count() == 5
    wait_for(lambda: queue.has_all(ids), what="all of them, as room frees", context=relay.output)
    assert not DeadLetter.objects.exists()


def _bind(url: str, queue_name: str) -> None:
    host = url.split("@", 1)[1].rstrip("/")
    conn = amqp.Connection(host, userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()
        channel.exchange_declare(f"{queue_name}-x", "direct", durable=True, auto_delete=False)
        channel.queue_bind(queue_name, f"{queue_name}-x", "work")
    finally:
        conn.close()


def test_connections_closed_by_the_broker_spend_no_retry(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """rabbitmqctl close_all_connections again and again: nothing is failed, everything arrives."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    queue.declare()
    relay = start_relay("--max-retries", "1", "--batch-size", "50", *QUICK, env=rabbit_env)
    ready(relay)
    ids: list[str] = []
    for _ in range(4):
        ids += enqueue(queue_name, count=200)
        private_rabbit.close_all_connections()
    wait_for(lambda: queue.has_all(ids), what="every message", context=relay.output)
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the rows deleted")
    assert not DeadLetter.objects.exists()


def test_broker_stopped_and_started_spends_no_retry(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """RabbitMQ down: the breaker opens, rows keep their retries; back up: they are published."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    queue.declare()
    relay = start_relay("--max-retries", "1", *QUICK, *SMALL, env=rabbit_env)
    ready(relay)
    private_rabbit.stop()
    ids = enqueue(queue_name, count=20)
    wait_for(
        lambda: "outbox.breaker_opened" in relay.output(),
        what="the breaker opening",
        context=relay.output,
    )
    time.sleep(2)
    _unspent()
    assert OutboxMessage.objects.count() == 20
    private_rabbit.start()
    wait_for(lambda: queue.has_all(ids), what="publishes after the restart", context=relay.output)
    assert not DeadLetter.objects.exists()


def test_unroutable_and_missing_exchange_fail_only_their_message(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """No binding for the key, or no exchange at all: that message dead-letters, the rest arrive."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    queue.declare()
    _bind(private_rabbit.url(), queue_name)
    relay = start_relay("--max-retries", "1", *QUICK, *SMALL, env=rabbit_env)
    ready(relay)
    bound = Exchange(f"{queue_name}-x", type="direct", no_declare=True)
    missing = Exchange(f"{queue_name}-missing", type="direct", no_declare=True)
    good = enqueue(queue_name, count=3)
    [unroutable] = enqueue(queue_name, exchange=bound, routing_key="nobody-listens")
    [lost] = enqueue(queue_name, exchange=missing, routing_key="work")
    good += enqueue(queue_name, count=3, exchange=bound, routing_key="work")
    wait_for(lambda: DeadLetter.objects.count() == 2, what="two dead letters", context=relay.output)
    reasons = dict(DeadLetter.objects.values_list("task_id", "failure_reason"))
    assert "unroutable" in reasons[unroutable]
    assert "NO_ROUTE" in reasons[unroutable]
    assert "NOT_FOUND" in reasons[lost]
    wait_for(lambda: queue.has_all(good), what="the routable messages", context=relay.output)
    assert unroutable not in queue.ids


def test_frozen_broker_is_an_outage_and_everything_arrives_after(
    start_relay: Any, rabbit_env: dict[str, Any], private_rabbit: Any, queue_name: str
) -> None:
    """RabbitMQ SIGSTOPped: confirms time out as outages, nothing dies, all arrive on SIGCONT."""
    queue = RabbitQueue(private_rabbit.url(), queue_name)
    queue.declare()
    relay = start_relay("--send-timeout", "1", "--max-retries", "1", *QUICK, *SMALL, env=rabbit_env)
    ready(relay)
    private_rabbit.freeze()
    try:
        ids = enqueue(queue_name, count=30)
        wait_for(
            lambda: "outbox.breaker_opened" in relay.output(),
            what="the breaker opening",
            context=relay.output,
        )
        _unspent()
    finally:
        private_rabbit.thaw()
    wait_for(lambda: queue.has_all(ids), what="publishes after the thaw", context=relay.output)
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the rows deleted")
    assert not DeadLetter.objects.exists()


def test_a_broker_frozen_before_the_confirm_channel_opens_is_an_outage(private_rabbit: Any) -> None:
    """Frozen between the connect and the confirm channel (a relay's start-up check, or its
    reconnect before a claim): BrokerUnavailable, and the pipelined path is back after."""
    app = celery.Celery("frozen-channel", broker=private_rabbit.url(), set_as_current=False)
    publisher = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=1))
    try:
        publisher.general.connect()  # connected, with kombu's channel; no confirm channel yet
        private_rabbit.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="confirm channel"):
                publisher.check()
            assert time.monotonic() - started < 10
        finally:
            private_rabbit.thaw()
        publisher.check()
        assert publisher.session is not None, "the general path stayed on after the thaw"
        assert publisher.can_overlap()
    finally:
        publisher.close()
