"""The compact layout (schema version 4) is small and loses nothing of the message.

- Decoded by the relay, a compact row gives the message Celery recorded (which version 1
  stores whole), for every task option of the contract.
- On Redis and on RabbitMQ, what the relay publishes for a compact row is what plain Celery
  publishes for the same call, byte for byte but the per-publish delivery tag and TTL.
- A queue the writer alone declares travels whole; a queue the relay's configuration
  declares otherwise than the writer's is not declared by the relay.
- A one-argument task with default options is stored in at most 400 bytes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import celery
import pytest
import redis
import structlog
from django.db import connection, transaction
from kombu import Connection, Exchange, Producer, Queue

from outbox_notify import OutboxCelery, compact, queues, serialization
from outbox_notify.app import RecordingProducer
from outbox_notify.relay import messages
from outbox_notify.relay.publisher import KombuPublisher, Result
from outbox_notify.relay.store import ClaimedRow
from tests.celery_app import app, fail, record

WHEN = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
NEVER = dt.datetime(2099, 12, 31, tzinfo=dt.UTC)
# An expiry RabbitMQ accepts as a message TTL (it refuses one decades ahead).
TOMORROW = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(days=1)
MAX_ROW_BYTES = 400  # the goal for a one-argument task with default options

# What Task.apply_async passes to send_task for a task with no options of its own.
DELAY = {"ignore_result": False, "priority": None}

# Every task option of the contract, and the rarer ones the compact layout must not lose.
CONTRACT: dict[str, dict[str, Any]] = {
    "delay()": DELAY,
    "send_task()": {},
    "countdown": {**DELAY, "countdown": 30},
    "eta": {**DELAY, "eta": WHEN},
    "expires in seconds": {**DELAY, "expires": 600},
    "expires at": {**DELAY, "expires": NEVER},
    "priority": {"priority": 7},
    "queue by name": {**DELAY, "queue": "compact-other"},
    "routing_key": {**DELAY, "routing_key": "compact-key"},
    "exchange by name": {**DELAY, "exchange": "compact-ex", "routing_key": "compact-key"},
    "exchange object": {
        **DELAY,
        "exchange": Exchange("compact-topic", type="topic"),
        "routing_key": "a.b",
    },
    "queue object": {
        **DELAY,
        "queue": Queue("compact-q", Exchange("compact-q-ex", type="topic"), routing_key="q.#"),
    },
    "custom headers": {**DELAY, "headers": {"x-tenant": "acme", "nested": {"a": [1, 2.5, None]}}},
    "a custom header named like Celery's": {**DELAY, "headers": {"retries": 3}},
    "link": {**DELAY, "link": record.s()},
    "link_error": {**DELAY, "link_error": fail.s()},
    "time limits": {**DELAY, "time_limit": 30, "soft_time_limit": 20},
    "shadow": {**DELAY, "shadow": "tests.add-shadow"},
    "ignore_result": {**DELAY, "ignore_result": True},
    "chain": {**DELAY, "chain": [record.s()]},
    "chord member": {**DELAY, "chord": record.s(), "group_id": "g-1", "group_index": 0},
    "group member": {**DELAY, "group_id": "g-2", "group_index": 3},
    "retries": {**DELAY, "retries": 2},
    "a worker task's child": {**DELAY, "root_id": "root-1", "parent_id": "parent-1"},
    "reply_to": {**DELAY, "reply_to": "elsewhere"},
    "correlation_id": {**DELAY, "correlation_id": "corr-1"},
    "stamps": {**DELAY, "stamped_headers": ["mark"], "mark": "v"},
    "pickle, transient": {**DELAY, "serializer": "pickle", "delivery_mode": 1},
    "compression": {**DELAY, "compression": "zlib"},
    "argsrepr given": {**DELAY, "argsrepr": "(hidden,)", "kwargsrepr": "{...}"},
    "origin given": {**DELAY, "origin": "elsewhere@host"},
}


def recorded(options: dict[str, Any], task_id: str | None = None) -> tuple[Any, dict[str, Any]]:
    """What Celery's own send_task hands the producer for tests.add(1, 2, k='v')."""
    recorder = RecordingProducer()
    given = {} if task_id is None else {"task_id": task_id}
    celery.Celery.send_task(
        app, "tests.add", (1, 2), {"k": "v"}, producer=recorder, **given, **options
    )
    assert recorder.recorded is not None
    return recorder.recorded


def claimed(row: serialization.OutboxRow) -> ClaimedRow:
    """The row as a relay's claim returns it."""
    return ClaimedRow(
        id=1,
        task_id=row.task_id,
        task_name=row.task_name,
        args=row.args,
        kwargs=row.kwargs,
        options=row.options,
        context=row.context,
        retries=0,
        schema_version=row.schema_version,
        created_at=dt.datetime.now(dt.UTC),
    )


def view(message: messages.OutgoingMessage) -> str:
    """Everything the relay publishes a message with, types and key order included."""
    spec = message.spec
    published = {
        "body": message.body,
        "headers": list(message.headers.items()),
        "properties": list(spec.properties.items()),
        "exchange": serialization.exchange_to_json(spec.exchange),
        "routing_key": spec.routing_key,
        "serializer": spec.serializer,
        "compression": spec.compression,
        "delivery_mode": spec.delivery_mode,
        "declare": [queues.declaration_text(q) for q in spec.declare_json],
        "embed": list(spec.embed.items()),
        "expiration": message.expiration,
        "sent_event": spec.sent_event,
        "content_type": message.content_type,
        "plain": message.plain,
    }
    return repr(published)


@pytest.mark.parametrize("case", list(CONTRACT))
def test_a_compact_row_publishes_the_message_celery_recorded(case: str) -> None:
    """For every contract option, the version 4 row decodes to what version 1 stores whole."""
    body, publish_kwargs = recorded(dict(CONTRACT[case]))
    full = serialization.build_row(body, publish_kwargs, relative={}, context={})
    small = compact.build_row(body, publish_kwargs, app=app, relative={}, context={})
    assert small.schema_version == serialization.COMPACT_VERSION
    assert len(small.options) < len(full.options)
    now = dt.datetime.now(dt.UTC)
    assert view(messages.prepare(claimed(small), now)) == view(messages.prepare(claimed(full), now))


def test_the_default_queue_is_named_not_declared_in_the_row() -> None:
    """A task routed to the app's configured queue stores its name and digest, no declaration."""
    body, publish_kwargs = recorded(DELAY)
    row = compact.build_row(body, publish_kwargs, app=app, relative={}, context={})
    options = json.loads(row.options)
    name, digest = options["queue"]
    assert name == app.conf.task_default_queue
    assert "declare" not in options
    assert "routing_key" not in options
    assert len(digest) == queues.DIGEST_CHARS


@pytest.fixture
def own_app() -> Iterator[OutboxCelery]:
    """An app of the test's own, which the relay's side also uses for the test."""
    own = OutboxCelery("compact-own", set_as_current=False)
    own.conf.update(broker_url="memory://")
    queues.use_app(own)
    yield own
    queues.use_app(None)


def _row(own: Any, **options: Any) -> serialization.OutboxRow:
    recorder = RecordingProducer()
    celery.Celery.send_task(own, "t", (1,), producer=recorder, **DELAY, **options)
    assert recorder.recorded is not None
    body, publish_kwargs = recorder.recorded
    return compact.build_row(body, publish_kwargs, app=own, relative={}, context={})


def _declared(row: serialization.OutboxRow) -> list[dict[str, Any]]:
    return messages.prepare(claimed(row), dt.datetime.now(dt.UTC)).spec.declare_json


def test_a_queue_declared_only_by_the_writer_travels_whole(own_app: OutboxCelery) -> None:
    """A queue added at run time (not in the configuration) is stored and declared as it is."""
    own_app.amqp.queues.select_add(Queue("writer-only", queue_arguments={"x-max-priority": 5}))
    row = _row(own_app, queue="writer-only")
    options = json.loads(row.options)
    assert "queue" not in options
    [declared] = _declared(row)
    assert (declared["name"], declared["queue_arguments"]) == ("writer-only", {"x-max-priority": 5})


def test_a_configured_queue_is_declared_as_the_relays_app_configures_it(
    own_app: OutboxCelery,
) -> None:
    """A queue of task_queues travels by name; the relay declares it with its arguments."""
    own_app.conf.task_queues = [Queue("configured", queue_arguments={"x-max-priority": 9})]
    row = _row(own_app, queue="configured")
    assert json.loads(row.options)["queue"][0] == "configured"
    [declared] = _declared(row)
    assert declared["queue_arguments"] == {"x-max-priority": 9}


def test_a_relay_configured_otherwise_declares_nothing(own_app: OutboxCelery) -> None:
    """Digests that differ (writer and relay configured apart): no declaration, one warning."""
    own_app.conf.task_queues = [Queue("drifted", queue_arguments={"x-max-priority": 9})]
    row = _row(own_app, queue="drifted")
    relay_app = OutboxCelery("compact-relay", set_as_current=False)
    relay_app.conf.update(broker_url="memory://")
    queues.use_app(relay_app)
    with structlog.testing.capture_logs() as logs:
        message = messages.prepare(claimed(row), dt.datetime.now(dt.UTC))
    assert message.spec.declare_json == []
    assert message.spec.routing_key == "drifted"
    [event] = [e for e in logs if e["event"] == "outbox.queue_declaration_differs"]
    assert event["queue"] == "drifted"


@pytest.mark.django_db
def test_a_one_argument_task_with_default_options_is_stored_in_at_most_400_bytes() -> None:
    """pg_column_size of the whole row of record.delay(42) is at most MAX_ROW_BYTES."""
    with transaction.atomic(), connection.cursor() as cursor:
        task_id = record.delay(42).id
        cursor.execute(
            "SELECT pg_column_size(t.*) FROM outbox_notify_message_v1 AS t WHERE task_id = %s",
            [task_id],
        )
        (size,) = cursor.fetchone()
    assert size <= MAX_ROW_BYTES


# --- on real brokers: the relay's message against plain Celery's ----------------------

ON_BROKERS: dict[str, dict[str, Any]] = {
    "delay()": DELAY,
    "several options": {
        **DELAY,
        "eta": WHEN,
        "expires": TOMORROW,
        "headers": {"x-tenant": "acme"},
        "time_limit": 30,
        "soft_time_limit": 20,
        "shadow": "tests.add-shadow",
        "ignore_result": True,
        "link": record.s(),
        "link_error": fail.s(),
        "group_id": "g-9",
        "group_index": 2,
    },
}


@dataclasses.dataclass
class Published:
    """The message plain Celery published and the one the relay published, as received."""

    plain: Any
    relayed: Any


@pytest.fixture
def on_broker(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test app pointed at the broker of the parameter (restored afterwards)."""
    url = request.getfixturevalue("redis_url" if request.param == "redis" else "amqp_url")
    before = app.conf.broker_url
    app.conf.broker_url = url
    yield url
    app.conf.broker_url = before


def _publish_both(options: dict[str, Any], queue: str) -> None:
    task_id = str(uuid.uuid4())
    with app.connection_for_write() as conn:
        producer = Producer(conn.default_channel)
        celery.Celery.send_task(
            app, "tests.add", (1, 2), {"k": "v"}, producer=producer, task_id=task_id,
            queue=queue, **options,
        )  # fmt: skip
    body, publish_kwargs = recorded({**options, "queue": queue}, task_id)
    row = compact.build_row(body, publish_kwargs, app=app, relative={}, context={})
    assert row.schema_version == serialization.COMPACT_VERSION
    publisher = KombuPublisher(app, send_timeout=5)
    try:
        message = messages.prepare(claimed(row), dt.datetime.now(dt.UTC))
        assert publisher.publish([message], lambda: False)[0].result is Result.PUBLISHED
    finally:
        publisher.close()


def _from_redis(url: str, queue: str) -> Published:
    client = redis.Redis.from_url(url)
    try:
        [key] = client.keys(f"{queue}*")
        plain, relayed = (json.loads(client.rpop(key)) for _ in range(2))
    finally:
        for key in client.keys(f"*{queue}*"):
            client.delete(key)
        client.close()
    for envelope in (plain, relayed):
        properties = envelope["properties"]
        properties.pop("delivery_tag")  # a fresh one per publish
        if "expiration" in properties:  # the TTL left: counted when each was sent
            properties["expiration"] = "(counted at send)"
        envelope["header order"] = list(envelope["headers"])
    return Published(plain=plain, relayed=relayed)


def _from_rabbitmq(url: str, queue: str) -> Published:
    with Connection(url) as conn:
        channel: amqp.Channel = conn.default_channel
        try:
            got = [channel.basic_get(queue, no_ack=True) for _ in range(2)]
        finally:
            channel.queue_delete(queue)
    views = []
    for message in got:
        assert message is not None
        properties = dict(message.properties)
        if "expiration" in properties:  # the TTL left: counted when each was sent
            properties["expiration"] = "(counted at send)"
        headers = properties.pop("application_headers")
        views.append(
            {"body": message.body, "properties": properties, "headers": list(headers.items())}
        )
    return Published(plain=views[0], relayed=views[1])


@pytest.mark.parametrize("on_broker", ["redis", "rabbitmq"], indirect=True)
@pytest.mark.parametrize("case", list(ON_BROKERS))
def test_the_relay_publishes_what_plain_celery_publishes(
    case: str, on_broker: str, queue_name: str
) -> None:
    """Same body, headers (in order), properties and routing as Celery's own publish."""
    _publish_both(ON_BROKERS[case], queue_name)
    if on_broker.startswith("redis"):
        published = _from_redis(on_broker, queue_name)
    else:
        published = _from_rabbitmq(on_broker, queue_name)
    assert published.relayed == published.plain
