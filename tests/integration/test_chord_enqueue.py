"""A chord's enqueue touches no result backend; its header rows carry the backend calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import redis
from celery import chain, chord, group
from celery.backends.cache import CacheBackend
from django.db import transaction

from outbox_notify import OutboxCelery, bulk, compact
from outbox_notify import _chord_calls as chord_calls
from outbox_notify.models import OutboxMessage
from outbox_notify.serialization import COMPACT_VERSION

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: what a commit or a rollback leaves in the table and in the backend.

UNREACHABLE = "redis://127.0.0.1:1/0"  # a port nothing listens on


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A Redis client on the result backend's database, closed after the test."""
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def _app(result_backend: str) -> tuple[OutboxCelery, object]:
    chord_app = OutboxCelery(f"chords-{result_backend}", set_as_current=False)
    chord_app.conf.update(
        broker_url=UNREACHABLE, result_backend=result_backend, cache_backend="memory://"
    )

    @chord_app.task(name="tests.mul", shared=False)
    def mul(x: int, y: int = 1) -> int:
        return x * y

    return chord_app, mul


def test_a_chord_enqueues_with_its_result_backend_down() -> None:
    """Nothing at enqueue needs the result backend: the rows carry its calls instead."""
    _, mul = _app(UNREACHABLE)
    with transaction.atomic():
        result = chord([mul.s(1, 1), mul.s(2, 2), mul.s(3, 3)])(mul.s(10))
    rows = list(OutboxMessage.objects.order_by("id"))
    assert len(rows) == 3
    group_id = result.parent.id
    for row in rows:
        assert row.schema_version == COMPACT_VERSION  # version 4 may carry backend_calls
        assert row.options["headers"]["group"] == group_id
        calls = {c["call"]: c["args"] for c in row.options["backend_calls"]}
        assert sorted(calls) == ["apply_chord", "set_chord_size"]  # Redis makes both
        assert calls["set_chord_size"] == [group_id, 3]


def test_a_rolled_back_chord_leaves_no_backend_key(redis_url: str, client: redis.Redis) -> None:
    """Rolled back, the chord's size was never written to the result backend."""
    _, mul = _app(redis_url)
    with pytest.raises(RuntimeError), transaction.atomic():
        result = chord([mul.s(1, 1), mul.s(2, 2)])(mul.s(10))
        group_id = result.parent.id
        raise RuntimeError("roll back")
    assert not client.exists(f"celery-taskset-meta-{group_id}.s")
    assert not OutboxMessage.objects.exists()


def test_a_header_of_groups_defers_apply_chord_too(redis_url: str, client: redis.Redis) -> None:
    """Redis saves a header made of groups at apply_chord: that call is carried as well, and
    the relay's replay of both calls writes what Celery would have written."""
    chord_app, mul = _app(redis_url)
    with transaction.atomic():
        result = chord([group(mul.s(1), mul.s(2)), mul.s(3, 3)])(mul.s(10))
    group_id = result.parent.id
    assert not client.exists(f"celery-taskset-meta-{group_id}")
    calls = {
        c["call"]: c for row in OutboxMessage.objects.all() for c in row.options["backend_calls"]
    }
    assert set(calls) == {"apply_chord", "set_chord_size"}
    # What the relay does with them: what Celery writes (here the size; Redis saves the header
    # only when Celery's freeze gave it a list rather than a lazy regen, which it did not).
    for call in calls.values():
        chord_calls.apply(chord_app.backend, chord_app, call)
    try:
        assert client.get(f"celery-taskset-meta-{group_id}.s") == b"3"
        assert client.exists(f"celery-taskset-meta-{group_id}") == 0
    finally:
        client.delete(f"celery-taskset-meta-{group_id}", f"celery-taskset-meta-{group_id}.s")
        chord_app.backend.client.close()


def test_plain_groups_and_tasks_carry_no_backend_calls() -> None:
    """Only chord headers carry result-backend calls; group members and tasks are plain."""
    _, mul = _app(UNREACHABLE)
    with transaction.atomic():
        group(mul.s(1), mul.s(2)).apply_async()
        mul.delay(3)
    assert {row.schema_version for row in OutboxMessage.objects.all()} == {COMPACT_VERSION}
    assert all("backend_calls" not in row.options for row in OutboxMessage.objects.all())


def test_a_chord_in_a_bulk_block_carries_its_calls_on_every_header_row() -> None:
    """Inside bulk() (small batches) the header rows stay together and all carry the calls."""
    _, mul = _app(UNREACHABLE)
    with bulk(batch_size=2):
        chord([mul.s(i, i) for i in range(5)])(mul.s(10))
    rows = list(OutboxMessage.objects.all())
    assert len(rows) == 5
    assert all(json.dumps(row.options).count("set_chord_size") == 1 for row in rows)


def test_an_incr_key_value_backend_defers_apply_chord() -> None:
    """A cache backend saves the header group at apply_chord: the relay makes that call."""
    chord_app, mul = _app("cache+memory://")
    with transaction.atomic():
        result = chord([mul.s(1, 1), mul.s(2, 2)])(mul.s(10))
    assert chord_app.backend.get(chord_app.backend.get_key_for_group(result.parent.id)) is None
    calls = {c["call"] for row in OutboxMessage.objects.all() for c in row.options["backend_calls"]}
    assert calls == {"apply_chord"}


class OwnChordBackend(CacheBackend):
    """A result backend whose apply_chord the outbox does not know (like django-celery-results,
    which writes a ChordCounter row through the ORM)."""

    implements_incr = False  # else CacheBackend replaces apply_chord with its own
    applied: ClassVar[list[str]] = []

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        self.applied.append(header_result_args[0])


def test_an_unknown_apply_chord_stays_at_the_call() -> None:
    """Such a backend's apply_chord runs at enqueue, as Celery would call it, and is not
    replayed by the relay (its effect need not be idempotent)."""
    _, mul = _app(f"{__name__}:OwnChordBackend")
    with transaction.atomic():
        result = chord([mul.s(1, 1)])(mul.s(10))
    assert OwnChordBackend.applied == [result.parent.id]
    assert all("backend_calls" not in row.options for row in OutboxMessage.objects.all())


def _calls(row: OutboxMessage) -> list[tuple[str, list[Any]]]:
    return [(c["call"], c["args"]) for c in row.options.get("backend_calls", [])]


def _group(row: OutboxMessage) -> Any:
    """The `group` header a row's message carries, whatever its stored layout."""
    spec = compact.decode_any(
        row.options,
        task_id=row.task_id,
        task_name=row.task_name,
        schema_version=row.schema_version,
    )
    return spec.headers.get("group")


def test_a_chord_whose_header_is_a_chain_carries_its_calls_on_the_chains_first_row() -> None:
    """A chain in a chord's header is written as its first task, with no group in its headers
    (the chain's last task joins the chord, from a worker): that row carries the calls."""
    _, mul = _app(UNREACHABLE)
    with transaction.atomic():
        result = chord([chain(mul.s(1, 1), mul.s(2))])(mul.s(10))
    (row,) = OutboxMessage.objects.all()
    assert _group(row) is None
    assert ("set_chord_size", [result.parent.id, 1]) in _calls(row)


def test_a_chord_in_a_chords_header_carries_both_chords_calls() -> None:
    """The inner chord's header rows carry its calls and the outer chord's (the inner body,
    sent by a worker later, completes the outer chord's part); the others only the outer's."""
    _, mul = _app(UNREACHABLE)
    with transaction.atomic():
        result = chord([chord([mul.s(1, 1), mul.s(2, 2)], mul.s(3)), mul.s(4, 4)])(mul.s(10))
    outer = result.parent.id
    rows = {row.args[0]: row for row in OutboxMessage.objects.all()}
    inner = _group(rows[1])
    sizes = {
        n: sorted(args for call, args in _calls(row) if call == "set_chord_size")
        for n, row in rows.items()
    }
    assert sizes == {
        1: sorted([[inner, 2], [outer, 2]]),
        2: sorted([[inner, 2], [outer, 2]]),
        4: [[outer, 2]],
    }


def test_chords_in_a_group_carry_only_their_own_calls() -> None:
    """A group of chords: each chord's header rows carry that chord's calls and no other's."""
    _, mul = _app(UNREACHABLE)
    with transaction.atomic():
        group(chord([mul.s(n, 1), mul.s(n, 2)], mul.s(10)) for n in range(3)).apply_async()
    rows = list(OutboxMessage.objects.all())
    assert len(rows) == 6
    for row in rows:
        own = _group(row)
        assert {args[0] for _, args in _calls(row)} == {own}
