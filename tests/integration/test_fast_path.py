"""The Redis fast path writes the same envelope kombu's Producer would, with or without orjson."""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

import celery
import pytest
import redis

from outbox_notify.app import RecordingProducer
from outbox_notify.relay import fastjson, messages
from outbox_notify.relay.publisher import KombuPublisher, Result
from outbox_notify.relay.redis_publisher import RedisPipelinePublisher
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.serialization import build_row
from tests.celery_app import app


def claimed(queue: str, **options: Any) -> ClaimedRow:
    """A row as the write side would have stored it for add(1, 2) routed to `queue`."""
    recorder = RecordingProducer()
    celery.Celery.send_task(
        app, "tests.add", (1, 2), {"k": "v"}, producer=recorder, queue=queue, **options
    )
    assert recorder.recorded is not None
    body, publish_kwargs = recorder.recorded
    row = build_row(body, publish_kwargs, relative={}, context={})
    return ClaimedRow(
        1,
        row.task_id,
        row.task_name,
        row.args,
        row.kwargs,
        row.options,
        row.context,
        0,
        1,
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
