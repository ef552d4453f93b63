"""Two batches in flight on RabbitMQ: the next batch is claimed and written while the previous
one awaits its publisher confirms (real broker, real PostgreSQL, real relay)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import amqp
import celery
import psycopg
import pytest
from django.db import connection, transaction
from kombu import Exchange

from outbox_notify.models import DeadLetter, OutboxMessage
from outbox_notify.relay import messages, runner
from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.config import CLAIM_APPLICATION_NAME
from outbox_notify.relay.publisher import KombuPublisher, Result
from outbox_notify.relay.store import ClaimStore, ClaimWouldWait
from tests.celery_app import add
from tests.integration.test_fast_path import claimed
from tests.integration.test_relay import FAST, ready
from tests.relay_support import wait_for

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def broker(amqp_url: str) -> Iterator[amqp.Channel]:
    """A raw py-amqp channel on the shared RabbitMQ, to set up and read queues."""
    host = amqp_url.split("@", 1)[1].rstrip("/")
    conn = amqp.Connection(host, userid="guest", password="guest")
    conn.connect()
    try:
        yield conn.channel()
    finally:
        conn.close()


@pytest.fixture
def fast(amqp_url: str) -> Iterator[AmqpConfirmPublisher]:
    app = celery.Celery("amqp-overlap", broker=amqp_url, set_as_current=False)
    publisher = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=5))
    try:
        yield publisher
    finally:
        publisher.close()


def _ids(broker: amqp.Channel, queue: str) -> list[str]:
    ids = []
    while (message := broker.basic_get(queue, no_ack=True)) is not None:
        ids.append(message.properties["application_headers"]["id"])
    return ids


def test_two_batches_in_flight_are_each_settled_by_their_own_confirms(
    broker: amqp.Channel, fast: AmqpConfirmPublisher, queue_name: str
) -> None:
    """The second batch is written before the first's confirms are read; a message of the
    second that no queue takes (basic.return) fails alone, everything else is confirmed."""
    exchange = f"{queue_name}-x"
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    broker.exchange_declare(exchange, "direct", durable=True, auto_delete=False)
    now = dt.datetime.now(dt.UTC)
    first = [messages.prepare(claimed(queue_name), now) for _ in range(300)]
    second = [messages.prepare(claimed(queue_name), now) for _ in range(300)]
    nowhere = claimed(
        queue_name, exchange=Exchange(exchange, type="direct", no_declare=True), routing_key="no"
    )
    second[150] = messages.prepare(nowhere, now)
    try:
        pending_first = fast.start(first, lambda: False)
        pending_second = fast.start(second, lambda: False)
        assert fast.session is not None
        assert len(fast.session.batches) == 2  # both written, neither awaited yet
        first_attempts = pending_first.wait()
        second_attempts = pending_second.wait()
        assert fast.session.batches == []
        assert [a.result for a in first_attempts] == [Result.PUBLISHED] * 300
        results = [a.result for a in second_attempts]
        assert results[150] is Result.FAILED
        assert "unroutable" in (second_attempts[150].error or "")
        assert results[:150] + results[151:] == [Result.PUBLISHED] * 299
        arrived = Counter(_ids(broker, queue_name))
        sent = [m.row.task_id for m in first + second if m is not second[150]]
        assert arrived == Counter(sent)
    finally:
        broker.queue_delete(queue_name)
        broker.exchange_delete(exchange)


def test_a_cancelled_batch_is_no_longer_tracked_and_the_next_one_settles(
    broker: amqp.Channel, fast: AmqpConfirmPublisher, queue_name: str
) -> None:
    """A batch whose claim is rolled back (a database failure) stops being awaited; the
    confirms of its messages do not leak into the next batch's outcome."""
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    now = dt.datetime.now(dt.UTC)
    try:
        abandoned = fast.start(
            [messages.prepare(claimed(queue_name), now) for _ in range(50)], lambda: False
        )
        abandoned.cancel()
        assert fast.session is not None
        assert fast.session.batches == []
        attempts = fast.publish(
            [messages.prepare(claimed(queue_name), now) for _ in range(50)], lambda: False
        )
        assert [a.result for a in attempts] == [Result.PUBLISHED] * 50
    finally:
        broker.queue_delete(queue_name)


@pytest.mark.django_db(transaction=True)  # the relay is another process: committed rows only
def test_relay_drains_many_batches_with_two_claims_once_each(
    broker: amqp.Channel,
    start_relay: Any,
    relay_env: dict[str, Any],
    amqp_url: str,
    queue_name: str,
) -> None:
    """A relay on RabbitMQ holds two claim connections; 235 tasks in batches of 10 arrive
    exactly once each, nothing is left in the outbox and nothing is dead-lettered."""
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    relay = start_relay(
        "--batch-size", "10", *FAST, env=dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)
    )
    try:
        ready(relay)
        with transaction.atomic():
            ids = [add.apply_async((n, n), queue=queue_name).id for n in range(235)]
        arrived: list[str] = []

        def all_arrived() -> bool:
            arrived.extend(_ids(broker, queue_name))
            return len(arrived) >= len(ids)

        wait_for(all_arrived, what="every task", context=relay.output)
        wait_for(lambda: not OutboxMessage.objects.exists(), what="the rows deleted")
        arrived.extend(_ids(broker, queue_name))
        assert Counter(arrived) == Counter(ids)
        assert not DeadLetter.objects.exists()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database()",
                [CLAIM_APPLICATION_NAME],
            )
            assert cursor.fetchone() == (2,)
    finally:
        broker.queue_delete(queue_name)


def _via(exchange: str, queue: str, count: int, first_id: int) -> list[messages.OutgoingMessage]:
    """Prepared messages routed through a named exchange, with row ids from first_id."""
    now = dt.datetime.now(dt.UTC)
    named = Exchange(exchange, type="direct", no_declare=True)
    return [
        messages.prepare(
            dataclasses.replace(claimed(queue, exchange=named, routing_key="k"), id=first_id + n),
            now,
        )
        for n in range(count)
    ]


def test_a_channel_closed_by_the_batch_in_flight_blames_nobody_in_the_next_one(
    broker: amqp.Channel, fast: AmqpConfirmPublisher, queue_name: str
) -> None:
    """The first batch's exchange is deleted after the relay checked it, so the broker closes
    the confirm channel; the next batch, which needs an exchange check of its own, is not
    blamed for it and the check does not raise: the first batch's messages are released
    (suspects), the next batch goes out."""
    gone, kept = f"{queue_name}-gone", f"{queue_name}-kept"
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    for exchange in (gone, kept):
        broker.exchange_declare(exchange, "direct", durable=False, auto_delete=False)
        broker.queue_bind(queue_name, exchange, "k")
    try:
        assert [a.result for a in fast.publish(_via(gone, queue_name, 1, 1), lambda: False)] == [
            Result.PUBLISHED
        ]
        broker.exchange_delete(gone)
        in_flight = fast.start(_via(gone, queue_name, 4, 10), lambda: False)
        time.sleep(0.3)  # the broker's channel.close is waiting on the socket
        fast.check()
        assert fast.can_overlap()
        next_batch = fast.start(_via(kept, queue_name, 2, 20), lambda: False)
        first = in_flight.wait()
        second = next_batch.wait()
        assert [a.result for a in first] == [Result.SKIPPED] * 4
        assert set(fast.isolation.suspects) == {10, 11, 12, 13}
        assert [a.result for a in second] == [Result.PUBLISHED] * 2
    finally:
        broker.queue_delete(queue_name)
        broker.exchange_delete(kept)


def test_a_message_that_breaks_the_connection_is_found_with_two_batches_in_flight(
    broker: amqp.Channel, amqp_url: str, queue_name: str
) -> None:
    """Headers larger than a frame break the connection every time: whichever batch sees the
    break, every unsettled message of both becomes a suspect, and over the next attempts the
    culprit alone fails while the others are published."""
    app = celery.Celery("amqp-overlap-break", broker=amqp_url, set_as_current=False)
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    now = dt.datetime.now(dt.UTC)

    def batch(ids: range, huge: int | None = None) -> list[messages.OutgoingMessage]:
        made = []
        for row_id in ids:
            extra = {"headers": {"x-big": "a" * 300_000}} if row_id == huge else {}
            row = dataclasses.replace(claimed(queue_name, **extra), id=row_id)
            made.append(messages.prepare(row, now))
        return made

    outcome: dict[int, Result] = {}
    publisher = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=2))
    try:
        for _ in range(8):
            publisher.check()  # a reconnect happens here, with nothing in flight
            batches = [
                [m for m in batch(range(1, 6), huge=3) if m.row.id not in outcome],
                [m for m in batch(range(11, 16)) if m.row.id not in outcome],
            ]
            pending = []
            for sent in batches:
                if sent:
                    pending.append((sent, publisher.start(sent, lambda: False)))
                    time.sleep(0.2)  # the break is waiting on the socket when check() runs
                    publisher.check()
            for sent, started in pending:
                for message, attempt in zip(sent, started.wait(), strict=True):
                    if attempt.result in (Result.PUBLISHED, Result.FAILED):
                        outcome[message.row.id] = attempt.result
            if len(outcome) == 10:
                break
    finally:
        publisher.close()
        broker.queue_delete(queue_name)
    assert outcome[3] is Result.FAILED
    assert {i: r for i, r in outcome.items() if i != 3} == dict.fromkeys(
        [1, 2, 4, 5, 11, 12, 13, 14, 15], Result.PUBLISHED
    )


@pytest.mark.django_db(transaction=True)
def test_a_claim_beside_another_gives_up_on_a_table_locked_behind_it() -> None:
    """A lock request queued behind one claim (TRUNCATE, ALTER TABLE, a migration) makes a
    second claim of the same relay give up after lock_wait instead of queueing behind it:
    waiting there, the relay would wait for itself, and so would the lock request."""
    params = runner.connection_kwargs("default")
    first, second = (ClaimStore(params, stale_timeout=30) for _ in range(2))
    first.connect()
    second.connect()
    locked = threading.Event()
    errors: list[BaseException] = []

    def lock_table() -> None:
        try:
            with psycopg.connect(**params, autocommit=False) as conn:
                conn.execute("SET lock_timeout = '20s'")
                conn.execute("LOCK TABLE outbox_notify_message_v1 IN ACCESS EXCLUSIVE MODE")
                locked.set()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    try:
        with first.claim(10):
            locker = threading.Thread(target=lock_table)
            locker.start()
            time.sleep(0.5)  # the LOCK is queued behind the first claim
            started = time.monotonic()
            with pytest.raises(ClaimWouldWait), second.claim(10, lock_wait=0.3):
                pytest.fail("the claim must not be granted while the LOCK waits")
            assert time.monotonic() - started < 5
            assert not locked.is_set()
        locker.join(timeout=10)  # the first claim ended: the LOCK goes ahead
        assert locked.is_set(), errors
        with second.claim(10) as claim:  # the table is free again: claims as usual
            assert claim.rows == []
    finally:
        first.close()
        second.close()


@pytest.mark.django_db(transaction=True)
def test_a_relay_draining_two_batches_at_a_time_lets_a_table_lock_through(
    broker: amqp.Channel,
    start_relay: Any,
    relay_env: dict[str, Any],
    amqp_url: str,
    queue_name: str,
) -> None:
    """ACCESS EXCLUSIVE locks taken again and again on the outbox table while the relay
    drains a backlog in small batches: each is granted within seconds (none waits for a relay
    that waits for it), and every task still arrives once."""
    broker.queue_declare(queue_name, durable=True, auto_delete=False)
    relay = start_relay(
        "--batch-size", "5", *FAST, env=dict(relay_env, OUTBOX_TEST_BROKER_URL=amqp_url)
    )
    params = runner.connection_kwargs("default")
    try:
        ready(relay)
        with transaction.atomic():
            ids = [add.apply_async((n, n), queue=queue_name).id for n in range(3000)]
        waits = []
        with psycopg.connect(**params, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '10s'")
            for _ in range(15):
                started = time.monotonic()
                with conn.transaction():
                    conn.execute("LOCK TABLE outbox_notify_message_v1 IN ACCESS EXCLUSIVE MODE")
                waits.append(time.monotonic() - started)
                time.sleep(0.05)
        assert max(waits) < 5, waits
        arrived: list[str] = []

        def all_arrived() -> bool:
            arrived.extend(_ids(broker, queue_name))
            return len(arrived) >= len(ids)

        wait_for(all_arrived, what="every task", context=relay.output)
        assert Counter(arrived) == Counter(ids)
    finally:
        broker.queue_delete(queue_name)
