"""Chords through the outbox with a real relay, worker and Redis result backend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chord
from django.db import transaction

from tests.acceptance.test_worker import FAST, executions
from tests.celery_app import app, record
from tests.relay_support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]
# transaction=True: the relay and the worker are other processes; only commits reach them.

SETTLE = 3.0  # seconds to wait for an execution that must not happen


def size_key(group_id: str) -> str:
    """The Redis result backend's key for a chord's size."""
    return app.backend.get_key_for_group(group_id, ".s").decode()


def markers(path: Path) -> list[str]:
    """The first string argument of every execution the worker recorded."""
    found = []
    for execution in executions(path):
        args = execution["args"]
        found.append(next((a for a in args if isinstance(a, str)), repr(args)))
    return found


def test_a_chord_runs_its_header_and_its_body_once_and_a_rolled_back_one_leaves_nothing(
    start_relay: Any, start_worker: Any, queue_name: str, redis_url: str
) -> None:
    """The relay sets the chord's size before its header runs; the body runs exactly once.
    A rolled-back chord never reaches the result backend."""
    q = queue_name
    backend = redis.Redis.from_url(app.conf.result_backend)
    relay = start_relay(*FAST)
    record_file = start_worker(q)
    header = [record.si(f"header-{n}").set(queue=q) for n in range(3)]
    with transaction.atomic():
        result = chord(header)(record.s("body").set(queue=q))
        group_id = result.parent.id
        assert not backend.exists(size_key(group_id))  # nothing at enqueue
    with pytest.raises(RuntimeError), transaction.atomic():
        rolled = chord([record.si("never").set(queue=q)])(record.s("never-body").set(queue=q))
        rolled_id = rolled.parent.id
        raise RuntimeError("roll back")
    wait_for(
        lambda: "body" in markers(record_file),
        timeout=60,
        what="the chord body",
        context=lambda: f"seen {markers(record_file)}\n{relay.output()[-3000:]}",
    )
    time.sleep(SETTLE)
    seen = markers(record_file)
    assert sorted(m for m in seen if m.startswith("header-")) == [
        "header-0",
        "header-1",
        "header-2",
    ]
    assert seen.count("body") == 1
    body = next(e for e in executions(record_file) if "body" in e["args"])
    assert body["args"][0] == ["recorded"] * 3
    assert "never" not in seen
    assert not backend.exists(size_key(rolled_id))
    assert not backend.keys(f"*{rolled_id}*")
