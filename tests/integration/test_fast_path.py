"""The Redis fast path writes the same envelope kombu's Producer would, with or without orjson."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import uuid
from typing import Any

import celery
import pytest
import redis
from kombu.transport.virtual import base as kombu_base

from outbox_notify import _compat
from outbox_notify.app import RecordingProducer
from outbox_notify.compact import build_row
from outbox_notify.relay import fastjson, messages
from outbox_notify.relay.publisher import KombuPublisher, Result
from outbox_notify.relay.redis_publisher import RedisPipelinePublisher
from outbox_notify.relay.store import ClaimedRow
from tests.celery_app import app


def claimed(queue: Any, **options: Any) -> ClaimedRow:
    """A row as the write side would have stored it for add(1, 2) routed to `queue` (the
    compact layout: tests/integration/test_compact_rows.py shows version 1's gives the same)."""
    recorder = RecordingProducer()
    celery.Celery.send_task(
        app, "tests.add", (1, 2), {"k": "v"}, producer=recorder, queue=queue, **options
    )
    assert recorder.recorded is not None
    body, publish_kwargs = recorder.recorded
    row = build_row(body, publish_kwargs, app=app, relative={}, context={})
    return ClaimedRow(
        1,
        row.task_id,
        row.task_name,
        row.args,
        row.kwargs,
        row.options,
        row.context,
        0,
        row.schema_version,
        dt.datetime.now(dt.UTC),
    )


def normalised(raw: bytes) -> dict[str, Any]:
    """An envelope without the per-publish delivery tag."""
    envelope = json.loads(raw)
    envelope["properties"].pop("delivery_tag")
    return envelope


@pytest.mark.parametrize("use_orjson", [True, False])
def test_fast_path_envelope_equals_kombus(
    redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch, use_orjson: bool
) -> None:
    """Same headers, properties, body, encoding and priority key as kombu.Producer.publish."""
    if not use_orjson:
        monkeypatch.setattr(fastjson, "orjson", None)
    elif not fastjson.AVAILABLE:
        pytest.fail("orjson is part of the test extra and must be installed")
    app.conf.broker_url = redis_url
    options = {"priority": 3, "headers": {"x-h": "v"}, "expires": 600, "countdown": 5}
    # One message, published once through each path onto the same queue.
    message = messages.prepare(claimed(queue_name, **options), dt.datetime.now(dt.UTC))
    kombu_publisher = KombuPublisher(app, send_timeout=5)
    fast_publisher = RedisPipelinePublisher(KombuPublisher(app, send_timeout=5))
    client = redis.Redis.from_url(redis_url)
    key = f"{queue_name}\x06\x163"  # kombu's Redis key for priority 3
    try:
        assert kombu_publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
        assert fast_publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
        via_kombu = normalised(client.rpop(key))
        via_fast_path = normalised(client.rpop(key))
    finally:
        kombu_publisher.close()
        fast_publisher.close()
        client.delete(key)
    assert via_fast_path == via_kombu
    assert via_kombu["headers"]["x-h"] == "v"
    assert json.loads(base64.b64decode(via_kombu["body"])) == [
        [1, 2],
        {"k": "v"},
        messages.PLAIN_EMBED,
    ]


def _redis_app(redis_url: str, **transport_options: Any) -> celery.Celery:
    # Not the current app: other tests check which app this thread would send through.
    redis_app = celery.Celery("fast-path-options", broker=redis_url, set_as_current=False)
    redis_app.conf.broker_transport_options = transport_options
    return redis_app


def _keys(client: redis.Redis, queue: str) -> dict[bytes, list[dict[str, Any]]]:
    found: dict[bytes, list[dict[str, Any]]] = {}
    for key in client.keys(f"*{queue}*"):
        found[key] = [normalised(raw) for raw in client.lrange(key, 0, -1)]
    return found


@pytest.mark.parametrize(
    "options",
    [{"global_keyprefix": "outbox-test-prefix:"}, {"priority_steps": [0, 5, 9]}],
    ids=["global_keyprefix", "priority_steps"],
)
def test_fast_path_equals_kombu_with_transport_options(
    redis_url: str, queue_name: str, options: dict[str, Any]
) -> None:
    """A key prefix or custom priority steps give the same keys and envelopes as kombu's."""
    message = messages.prepare(claimed(queue_name, priority=7), dt.datetime.now(dt.UTC))
    kombu_queue, fast_queue = f"{queue_name}-kombu", f"{queue_name}-fast"
    kombu_publisher = KombuPublisher(_redis_app(redis_url, **options), send_timeout=5)
    fast_publisher = RedisPipelinePublisher(
        KombuPublisher(_redis_app(redis_url, **options), send_timeout=5)
    )
    client = redis.Redis.from_url(redis_url)
    try:
        for publisher, queue in ((kombu_publisher, kombu_queue), (fast_publisher, fast_queue)):
            spec = dataclasses.replace(message.spec, routing_key=queue, declare_json=[])
            routed = dataclasses.replace(message, spec=spec)
            assert publisher.publish([routed], lambda: False)[0].result is Result.PUBLISHED
        via_kombu, via_fast_path = _keys(client, kombu_queue), _keys(client, fast_queue)
    finally:
        kombu_publisher.close()
        fast_publisher.close()
        for key in client.keys(f"*{queue_name}*"):
            client.delete(key)
    assert {k.replace(b"-kombu", b""): v for k, v in via_kombu.items()} == {
        k.replace(b"-fast", b""): [_requeued(e, kombu_queue) for e in v]
        for k, v in via_fast_path.items()
    }
    assert len(via_kombu) == 1


def _requeued(envelope: dict[str, Any], queue: str) -> dict[str, Any]:
    envelope["properties"]["delivery_info"]["routing_key"] = queue
    return envelope


def test_queue_with_x_expires_takes_kombus_path(
    redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue declared with x-expires gets kombu's own publish (it refreshes the TTL)."""
    import structlog
    from kombu import Queue

    app.conf.broker_url = redis_url
    queue = Queue(queue_name, routing_key=queue_name, expires=60)
    message = messages.prepare(claimed(queue), dt.datetime.now(dt.UTC))
    assert message.spec.exchange == ""
    assert message.spec.declare_json
    kombu_publisher = KombuPublisher(app, send_timeout=5)
    fast_publisher = RedisPipelinePublisher(KombuPublisher(app, send_timeout=5))
    client = redis.Redis.from_url(redis_url)
    try:
        assert kombu_publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
        kombu_ttl = client.pttl(queue_name)
        client.delete(queue_name)
        with structlog.testing.capture_logs() as logs:
            assert fast_publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
        fast_ttl = client.pttl(queue_name)
        assert normalised(client.rpop(queue_name))["headers"]["id"] == message.row.task_id
    finally:
        kombu_publisher.close()
        fast_publisher.close()
        client.delete(queue_name)
    assert (fast_ttl > 0) == (kombu_ttl > 0)
    assert any(e["event"] == "outbox.fast_path_unavailable" for e in logs)


def test_named_exchange_without_a_binding_fails_on_redis(redis_url: str, queue_name: str) -> None:
    """kombu drops a message no queue is bound for; the relay fails it instead of counting it."""
    from kombu import Exchange, Queue

    app.conf.broker_url = redis_url
    exchange = Exchange(f"{queue_name}-x", type="direct")
    bound = Queue(queue_name, exchange, routing_key="work")
    now = dt.datetime.now(dt.UTC)
    good = messages.prepare(claimed(bound), now)
    lost = messages.prepare(
        claimed(queue_name, exchange=exchange, routing_key="nobody-listens"), now
    )
    publisher = RedisPipelinePublisher(KombuPublisher(app, send_timeout=5))
    client = redis.Redis.from_url(redis_url)
    try:
        attempts = publisher.publish([good, lost], lambda: False)
        waiting = [normalised(raw)["headers"]["id"] for raw in client.lrange(queue_name, 0, -1)]
    finally:
        publisher.close()
        for key in client.keys(f"*{queue_name}*"):
            client.delete(key)
    assert attempts[0].result is Result.PUBLISHED
    assert attempts[1].result is Result.FAILED
    assert "unroutable" in (attempts[1].error or "")
    assert waiting == [good.row.task_id]


def test_redis_gate_accepts_the_installed_releases() -> None:
    """The versions this suite runs on are inside the gate (else the fast path never ran)."""
    channel: Any = type("Channel", (), dict.fromkeys(_compat.REDIS_CHANNEL_NEEDS))()
    assert _compat.redis_problem(channel) is None


@pytest.mark.parametrize(
    ("gate", "reason"),
    [
        (("KOMBU_TESTED", ((9, 0), (9, 9))), "outside the tested"),
        (("REDIS_TESTED", ((9, 0), (9, 9))), "outside the tested"),
        (("REDIS_CHANNEL_NEEDS", (*_compat.REDIS_CHANNEL_NEEDS, "_no_such_internal")), "lacks"),
    ],
    ids=["kombu-version", "redis-version", "channel-state"],
)
def test_redis_gate_sends_through_kombu_and_says_why_once(
    redis_url: str,
    queue_name: str,
    monkeypatch: pytest.MonkeyPatch,
    gate: tuple[str, Any],
    reason: str,
) -> None:
    """Untested releases or a channel without a piece: kombu publishes, one log event says why."""
    import structlog

    monkeypatch.setattr(_compat, *gate)
    app.conf.broker_url = redis_url
    message = messages.prepare(claimed(queue_name), dt.datetime.now(dt.UTC))
    publisher = RedisPipelinePublisher(KombuPublisher(app, send_timeout=5))
    sent_by_kombu: list[str] = []
    publish_each = publisher.fallback.publish_each

    def counting(producer: Any, batch: Any, indexes: Any, deadline: Any) -> Any:
        sent_by_kombu.extend(batch[i].row.task_id for i in indexes)
        return publish_each(producer, batch, indexes, deadline)

    monkeypatch.setattr(publisher.fallback, "publish_each", counting)
    client = redis.Redis.from_url(redis_url)
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                assert publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
        waiting = [normalised(raw)["headers"]["id"] for raw in client.lrange(queue_name, 0, -1)]
    finally:
        publisher.close()
        client.delete(queue_name)
    assert waiting == [message.row.task_id] * 2
    assert sent_by_kombu == [message.row.task_id] * 2
    unavailable = [e for e in logs if e["event"] == "outbox.fast_path_unavailable"]
    assert len(unavailable) == 1
    assert reason in unavailable[0]["reason"]


def _sockets(channel: Any) -> int:
    """Connections opened so far by both of the channel's pools (pipelines, declarations)."""
    with channel.conn_or_acquire() as client:
        pools = (channel.client.connection_pool, client.connection_pool)
        return sum(pool._created_connections for pool in pools)


def test_check_readies_a_new_connection_before_its_first_publish(
    redis_url: str, queue_name: str
) -> None:
    """check(), called before each claim, opens the sockets and reads the gate's releases for
    a new connection, so the first batch after a start or a reconnect does not do it inside
    its claim; the same again after a reconnect."""
    message = messages.prepare(claimed(queue_name), dt.datetime.now(dt.UTC))
    publisher = RedisPipelinePublisher(KombuPublisher(_redis_app(redis_url), send_timeout=5))
    client = redis.Redis.from_url(redis_url)
    try:
        for _connection in range(2):
            publisher.check()
            producer = publisher.fallback.producer
            assert producer is not None
            opened = _sockets(producer.channel)
            assert opened >= 2, "check() left a pool without a connection"
            for _ in range(2):
                publisher.check()
                assert publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
            assert _sockets(producer.channel) == opened, "the first publish opened a socket"
            publisher.close()
        assert client.llen(queue_name) == 4
    finally:
        publisher.close()
        client.delete(queue_name)


@pytest.mark.parametrize(
    ("reply", "outage"),
    [("MISCONF Redis is configured to save RDB snapshots", True), ("ERR unknown command", False)],
    ids=["refuses-writes", "other-error"],
)
def test_a_warm_up_refused_is_an_outage_and_any_other_error_is_let_go(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, reply: str, outage: bool
) -> None:
    """Readying a new channel is an optimisation: Redis refusing every write is an outage
    (BrokerUnavailable, before any claim), any other error is logged and the relay goes on."""
    import contextlib

    import structlog

    from outbox_notify.exceptions import BrokerUnavailable

    publisher = RedisPipelinePublisher(KombuPublisher(_redis_app(redis_url), send_timeout=5))

    class Refusing:
        def ping(self) -> None:
            raise redis.ResponseError(reply)

    @contextlib.contextmanager
    def refusing() -> Any:
        yield Refusing()

    try:
        publisher.fallback.check()
        producer = publisher.fallback.producer
        assert producer is not None
        monkeypatch.setattr(producer.channel, "conn_or_acquire", refusing, raising=False)
        with structlog.testing.capture_logs() as logs:
            if outage:
                with pytest.raises(BrokerUnavailable, match="refuses writes"):
                    publisher.check()
            else:
                publisher.check()
                publisher.check()  # readied once: not tried again on the same channel
        events = [e["event"] for e in logs]
        assert events == ([] if outage else ["outbox.broker_warm_up_failed"])
    finally:
        publisher.close()


def test_fast_path_delivery_tags_are_fresh_uuid4s_made_without_uuid4(
    redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 600 messages (more than one urandom read of tags) gets 600 different
    version-4 UUIDs, each one the publisher's DeliveryTags handed out, none from kombu's uuid4
    (which this test makes fail)."""

    def no_uuid4() -> Any:
        raise AssertionError("kombu's uuid4 was asked for a delivery tag")

    monkeypatch.setattr(kombu_base, "uuid", no_uuid4)
    app.conf.broker_url = redis_url
    batch = [messages.prepare(claimed(queue_name), dt.datetime.now(dt.UTC)) for _ in range(600)]
    publisher = RedisPipelinePublisher(KombuPublisher(app, send_timeout=5))
    handed: list[str] = []
    draw = publisher.tags

    def recorded() -> str:
        tag = draw()
        handed.append(tag)
        return tag

    monkeypatch.setattr(publisher, "tags", recorded)
    client = redis.Redis.from_url(redis_url)
    try:
        attempts = publisher.publish(batch, lambda: False)
        raws = client.lrange(queue_name, 0, -1)
    finally:
        publisher.close()
        for key in client.keys(f"*{queue_name}*"):  # the queue and kombu's binding
            client.delete(key)
    assert [a for a in attempts if a.result is not Result.PUBLISHED] == []
    tags = [json.loads(raw)["properties"]["delivery_tag"] for raw in raws]
    assert len(set(tags)) == 600
    assert sorted(tags) == sorted(handed)
    for tag in tags:
        parsed = uuid.UUID(tag)
        assert (str(parsed), parsed.version, parsed.variant) == (tag, 4, uuid.RFC_4122)
