"""Rows of every schema_version a release has written are still published by the current relay.

tests/schema_rows/vN.json holds rows exactly as release N's writer stored them (frozen once
released, made by tests/schema_rows/capture.py), each with what the worker must receive.
Adding schema version N+1 means adding its decoder (relay/messages.py) and its fixture; the
fixtures of older versions stay, so a relay never loses the ability to publish them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from kombu import Connection, Exchange, Queue
from kombu.utils import json as kombu_json

from outbox_notify.models import DeadLetter, OutboxMessage
from outbox_notify.relay import messages
from outbox_notify.serialization import SCHEMA_VERSION
from tests.relay_support import RedisQueue, wait_for
from tests.schema_rows.capture import QUEUE

FIXTURES = Path(__file__).resolve().parents[1] / "schema_rows"
INSERT = """
    INSERT INTO outbox_notify_message_v1
        (task_id, task_name, args, kwargs, options, context, schema_version)
    VALUES (%(task_id)s, %(task_name)s, %(args)s::json, %(kwargs)s::json, %(options)s::json,
            %(context)s::json, %(schema_version)s)
"""


def _fixture(version: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"v{version}.json").read_text())
    return data


def test_every_version_up_to_the_current_one_has_a_decoder_and_a_fixture() -> None:
    """Versions 1..SCHEMA_VERSION each have a decoder and a row fixture; none is dropped."""
    versions = list(range(1, SCHEMA_VERSION + 1))
    assert sorted(messages.DECODERS) == versions
    fixtures = sorted(int(p.stem[1:]) for p in FIXTURES.glob("v*.json"))
    assert fixtures == versions
    for version in versions:
        assert _fixture(version)["schema_version"] == version
        assert {row["columns"]["schema_version"] for row in _fixture(version)["rows"]} == {version}


def _insert(columns: dict[str, Any], queue: str) -> None:
    """Store the row as its release wrote it, routed to this test's own queue."""
    values = {
        key: value.replace(QUEUE, queue) if isinstance(value, str) else value
        for key, value in columns.items()
    }
    with connection.cursor() as cursor:
        cursor.execute(INSERT, values)


def _embed_tasks(embed: dict[str, Any]) -> dict[str, list[str]]:
    return {
        key: [signature["task"] for signature in embed[key]]
        for key in ("callbacks", "errbacks", "chain")
        if embed.get(key)
    }


def _message_id(message: dict[str, Any]) -> str:
    headers = message["headers"]
    return str(headers["id"] if "id" in headers else headers["cloudEvents_id"])


def _check(message: dict[str, Any], expect: dict[str, Any], queue: str) -> None:
    """The published message carries what the worker (or an event's consumer) must see."""
    if "event" in expect:
        _check_event(message, expect)
        return
    # Decode the body again with kombu, so tagged datetimes, UUIDs, Decimals compare as values.
    args, kwargs, embed = kombu_json.loads(json.dumps(message["body"]))
    wanted = kombu_json.loads(json.dumps(expect))
    assert (args, kwargs) == (wanted["args"], wanted["kwargs"])
    assert _embed_tasks(embed) == wanted.get("embed_tasks", {})
    headers = message["headers"]
    assert {key: headers.get(key) for key in wanted.get("headers", {})} == wanted["headers"]
    assert message["properties"]["delivery_info"]["routing_key"] == queue


def _check_event(message: dict[str, Any], expect: dict[str, Any]) -> None:
    """A domain event row (version 3) arrives as its CloudEvent, headers and routing key."""
    assert message["body"] == expect["event"]
    assert message["headers"] == expect["headers"]
    assert message["content-type"] == "application/cloudevents+json"
    assert message["properties"]["delivery_info"]["routing_key"] == expect["routing_key"]


@pytest.fixture
def event_binding(redis_url: str, redis_queue: RedisQueue) -> Iterator[None]:
    """The test's queue bound to every key of a topic exchange named like it (event rows' route)."""
    exchange = Exchange(redis_queue.name, type="topic", durable=True)
    with Connection(redis_url) as conn:
        Queue(redis_queue.name, exchange, routing_key="#")(conn.default_channel).declare()
    yield
    for key in redis_queue.client.keys(f"*{redis_queue.name}*"):
        redis_queue.client.delete(key)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION + 1), ids=lambda v: f"v{v}")
def test_rows_of_each_version_are_published(
    version: int, start_relay: Any, redis_queue: RedisQueue, event_binding: None
) -> None:
    """A sweep of the current relay publishes every frozen row of that version as its writer meant."""
    # transaction=True: the relay runs in another process and sees only committed rows.
    rows = _fixture(version)["rows"]
    for row in rows:
        _insert(row["columns"], redis_queue.name)
    sweep = start_relay("--max-retries", "0", command="outbox_sweep")
    assert sweep.wait() == 0, sweep.output()
    wait_for(lambda: len(redis_queue.messages()) == len(rows), what="every row published")
    assert not DeadLetter.objects.exists(), list(DeadLetter.objects.values("failure_reason"))
    assert not OutboxMessage.objects.exists()
    published = {_message_id(m): m for m in redis_queue.messages()}
    for row in rows:
        _check(published[row["columns"]["task_id"]], row["expect"], redis_queue.name)
