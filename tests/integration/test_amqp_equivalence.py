"""The RabbitMQ fast path sends exactly what kombu's Producer.publish sends, on a real broker."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import amqp
import celery
import pytest
from kombu import Exchange

from outbox_notify import _compat
from outbox_notify.relay import messages
from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.publisher import KombuPublisher, Result
from tests.integration.test_fast_path import claimed


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
def publishers(amqp_url: str) -> Iterator[tuple[KombuPublisher, AmqpConfirmPublisher]]:
    """kombu's general path and the fast path, each on its own connection."""
    # Not the current app: other tests check which app this thread would send through.
    app = celery.Celery("amqp-equivalence", broker=amqp_url, set_as_current=False)
    general = KombuPublisher(app, send_timeout=5)
    fast = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=5))
    try:
        yield general, fast
    finally:
        general.close()
        fast.close()


def _setup(broker: amqp.Channel, queue: str, exchange: str, kind: str, binding: str) -> None:
    broker.queue_declare(queue, durable=True, auto_delete=False)  # as Celery declares it
    if exchange:
        broker.exchange_declare(exchange, kind, durable=True, auto_delete=False)
        broker.queue_bind(queue, exchange, binding)


def _got(broker: amqp.Channel, queue: str) -> amqp.Message:
    message = broker.basic_get(queue, no_ack=True)
    assert message is not None, f"nothing arrived in {queue}"
    return message


CASES: dict[str, dict[str, Any]] = {
    "default routing, priority, headers, expiry": {
        "priority": 3,
        "headers": {"x-h": "v", "nested": {"a": [1, 2]}},
        "expires": 600,
        "countdown": 5,
    },
    "zlib compression": {"compression": "zlib"},
    "pickle serializer, transient": {"serializer": "pickle", "delivery_mode": 1},
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_message_equals_kombus_on_the_default_route(
    case: str,
    broker: amqp.Channel,
    publishers: tuple[KombuPublisher, AmqpConfirmPublisher],
    queue_name: str,
) -> None:
    """Body, properties, headers, priority, expiration and delivery info are identical."""
    _compare(broker, publishers, queue_name, **CASES[case])


@pytest.mark.parametrize("kind", ["topic", "fanout", "direct"])
def test_fast_path_message_equals_kombus_through_a_named_exchange(
    kind: str,
    broker: amqp.Channel,
    publishers: tuple[KombuPublisher, AmqpConfirmPublisher],
    queue_name: str,
) -> None:
    """Through a topic, fanout or direct exchange the two paths deliver the same message."""
    exchange = f"{queue_name}-{kind}"
    _setup(broker, queue_name, exchange, kind, "orders.#" if kind == "topic" else "orders.new")
    try:
        _compare(
            broker,
            publishers,
            queue_name,
            exchange=Exchange(exchange, type=kind),
            routing_key="orders.new",
            priority=7,
        )
    finally:
        broker.exchange_delete(exchange)


def _compare(
    broker: amqp.Channel,
    publishers: tuple[KombuPublisher, AmqpConfirmPublisher],
    queue: str,
    **options: Any,
) -> None:
    general, fast = publishers
    message = messages.prepare(claimed(queue, **options), dt.datetime.now(dt.UTC))
    try:
        assert general.publish([message], lambda: False)[0].result is Result.PUBLISHED
        fast.check()
        assert fast.session is not None, "the fast path was not used"
        assert fast.publish([message], lambda: False)[0].result is Result.PUBLISHED
        via_kombu, via_fast_path = _got(broker, queue), _got(broker, queue)
    finally:
        broker.queue_delete(queue)
    assert via_fast_path.body == via_kombu.body
    assert via_fast_path.properties == via_kombu.properties
    for key in ("exchange", "routing_key"):
        assert via_fast_path.delivery_info[key] == via_kombu.delivery_info[key]
    assert via_kombu.properties["application_headers"]["id"] == message.row.task_id


def test_fast_path_declares_each_queue_once_per_connection(
    broker: amqp.Channel,
    publishers: tuple[KombuPublisher, AmqpConfirmPublisher],
    queue_name: str,
) -> None:
    """A queue Celery would declare is declared at the first message, then never again."""
    _, fast = publishers
    rows = [claimed(queue_name) for _ in range(3)]
    now = dt.datetime.now(dt.UTC)
    batch = [messages.prepare(r, now) for r in rows]
    declared: list[str] = []
    try:
        fast.check()
        assert fast.session is not None
        side = fast.general.producer.channel  # type: ignore[union-attr]
        original = side.queue_declare

        def counting(*args: Any, **kwargs: Any) -> Any:
            declared.append(kwargs.get("queue") or args[0])
            return original(*args, **kwargs)

        side.queue_declare = counting
        for _ in range(2):
            attempts = fast.publish(batch, lambda: False)
            assert [a.result for a in attempts] == [Result.PUBLISHED] * 3
        assert broker.queue_declare(queue_name, passive=True).message_count == 6
    finally:
        broker.queue_delete(queue_name)
    assert declared == [queue_name]


def test_gate_accepts_the_installed_releases() -> None:
    """The versions this suite runs on are inside the gates (else the fast paths never ran)."""
    channel: Any = type("Channel", (), {name: None for name in _compat.AMQP_CHANNEL_NEEDS})()
    transport = type("Transport", (), {"having_timeout": None, "sock": None})()
    connection: Any = type(
        "Connection", (), {**dict.fromkeys(_compat.AMQP_CONNECTION_NEEDS), "transport": transport}
    )()
    assert _compat.amqp_problem(connection, channel) is None


def test_fast_path_unavailable_is_logged_once_and_kombu_publishes(
    monkeypatch: pytest.MonkeyPatch,
    broker: amqp.Channel,
    publishers: tuple[KombuPublisher, AmqpConfirmPublisher],
    queue_name: str,
) -> None:
    """Outside the tested releases the general path publishes, and says so once."""
    import structlog

    monkeypatch.setattr(_compat, "AMQP_TESTED", ((9, 0), (9, 9)))
    _, fast = publishers
    now = dt.datetime.now(dt.UTC)
    batch = [messages.prepare(claimed(queue_name), now) for _ in range(2)]
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                assert [a.result for a in fast.publish(batch, lambda: False)] == [
                    Result.PUBLISHED
                ] * 2
        assert broker.queue_declare(queue_name, passive=True).message_count == 4
    finally:
        broker.queue_delete(queue_name)
    unavailable = [e for e in logs if e["event"] == "outbox.fast_path_unavailable"]
    assert len(unavailable) == 1
    assert "outside the tested" in unavailable[0]["reason"]
    assert fast.session is None
