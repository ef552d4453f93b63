"""The template path stores what Celery's full path stores, byte for byte, over many shapes.

Each case enqueues the same call three times with the same task id: once to build the
shape's template, once through the template, and once with the template path switched off
(Celery's own send_task against the recording producer). The last two rows must be equal in
every column, and for the shapes the template path takes, Celery must not have built the
second message. A divergence in any Celery behaviour the template mimics fails here.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import group
from celery import signals as celery_signals
from celery._state import _task_stack
from kombu import Exchange, Queue

from outbox_notify import OutboxCelery, bulk, compact
from outbox_notify._write import message_templates
from outbox_notify.app import RecordingProducer
from outbox_notify.serialization import OutboxRow
from tests.celery_app import add, app, record

pytestmark = pytest.mark.django_db

Send = Callable[[str], Any]


@dataclasses.dataclass
class Counter:
    """How many messages Celery built (full path) since the last reset."""

    built: int = 0


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the messages Celery's own send_task records (the template path records none)."""
    counter = Counter()
    real = RecordingProducer.publish

    def counting(self: RecordingProducer, body: Any, **kwargs: Any) -> None:
        if self.recorded is None:
            counter.built += 1
        real(self, body, **kwargs)

    monkeypatch.setattr(RecordingProducer, "publish", counting)
    return counter


def written(send: Send, task_id: str) -> OutboxRow:
    """The row one call produces (collected by a bulk block, then rolled back with it)."""
    with bulk() as collector:
        send(task_id)
        assert len(collector.rows) == 1
        row = collector.rows[0]
        collector.rows.clear()
    return row


def routing_key(row: OutboxRow) -> Any:
    """The routing key the row is published with."""
    return compact.routing_key_of(json.loads(row.options))


def through_both_paths(
    send: Send, monkeypatch: pytest.MonkeyPatch, built: Counter
) -> tuple[OutboxRow, OutboxRow, int]:
    """(template path row, full path row, messages Celery built for the template call)."""
    written(send, "first-" + uuid.uuid4().hex)  # builds the template of the shape
    built.built = 0
    task_id = "same-" + uuid.uuid4().hex
    templated = written(send, task_id)
    by_template = built.built
    with monkeypatch.context() as patch:
        patch.setattr(message_templates, "_publish_unobserved", lambda: False)
        full = written(send, task_id)
    return templated, full, by_template


class Point:
    """An argument saferepr shows through its repr (the template falls back to saferepr)."""

    def __repr__(self) -> str:
        return "Point(1, 2)"


TAGGED = (
    dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    uuid.UUID(int=7),
    decimal.Decimal("1.50"),
)
SHAPES: dict[str, Send] = {
    "delay-args": lambda tid: add.apply_async((1, 2), task_id=tid),
    "delay-kwargs": lambda tid: record.apply_async(kwargs={"x": 1, "y": "it's"}, task_id=tid),
    "list-args": lambda tid: record.apply_async([1.5, None, True], task_id=tid),
    "no-args": lambda tid: record.apply_async(task_id=tid),
    "nested-args": lambda tid: record.apply_async(([1, [2, {"a": (3,)}]], {"k": [1]}), task_id=tid),
    "unicode-args": lambda tid: record.apply_async(
        ("żółw \u2603 \n\t 'q' \"dq\"", "\\"), task_id=tid
    ),
    "long-args": lambda tid: record.apply_async(("x" * 5000, list(range(400))), task_id=tid),
    "tagged-args": lambda tid: record.apply_async(TAGGED, {"when": TAGGED[0]}, task_id=tid),
    "priority": lambda tid: add.apply_async((1, 2), priority=7, task_id=tid),
    "queue-name": lambda tid: add.apply_async((1, 2), queue="equivalence-q", task_id=tid),
    "queue-object": lambda tid: add.apply_async((1, 2), queue=EQ_QUEUE, task_id=tid),
    "exchange-routing-key": lambda tid: add.apply_async(
        (1, 2), exchange="equivalence-x", routing_key="rk.1", task_id=tid
    ),
    "exchange-object": lambda tid: add.apply_async(
        (1, 2), exchange=EQ_EXCHANGE, routing_key="rk.2", task_id=tid
    ),
    "serializer-delivery-mode": lambda tid: add.apply_async(
        (1, 2), serializer="json", delivery_mode=1, task_id=tid
    ),
    "limits": lambda tid: add.apply_async((1, 2), time_limit=30, soft_time_limit=20, task_id=tid),
    "ignore-result": lambda tid: add.apply_async((1, 2), ignore_result=True, task_id=tid),
    "shadow": lambda tid: add.apply_async((1, 2), shadow="shadowed", task_id=tid),
    "headers": lambda tid: add.apply_async(
        (1, 2), headers={"x-tenant": "acme", "x-n": 3, "x-d": {"a": [1, None]}}, task_id=tid
    ),
    "header-overriding-celery": lambda tid: add.apply_async(
        (1, 2), headers={"retries": 4}, task_id=tid
    ),
    "root-and-parent": lambda tid: add.apply_async(
        (1, 2), root_id="root-1", parent_id="parent-1", task_id=tid
    ),
    "group-member": lambda tid: add.apply_async(
        (1, 2), group_id="group-1", group_index=3, task_id=tid
    ),
    "send-task-registered": lambda tid: app.send_task("tests.add", (1, 2), task_id=tid),
    "send-task-remote": lambda tid: app.send_task(
        "remote.task", (1,), {"a": 1}, task_id=tid, priority=2
    ),
    "countdown": lambda tid: add.apply_async((1, 2), countdown=0.0, task_id=tid),
    "retries": lambda tid: add.apply_async((1, 2), retries=2, task_id=tid),
}
EQ_EXCHANGE = Exchange("equivalence-x", type="topic", durable=False)
EQ_QUEUE = Queue("equivalence-qo", EQ_EXCHANGE, routing_key="qo")
# Shapes whose calls can differ in more than the holes: Celery builds every message.
FULL_PATH_SHAPES = {"header-overriding-celery", "countdown"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_template_rows_equal_celerys_full_path_rows(
    shape: str, monkeypatch: pytest.MonkeyPatch, built: Counter
) -> None:
    """Every column of the templated row equals the row Celery's full path stores."""
    templated, full, by_template = through_both_paths(SHAPES[shape], monkeypatch, built)
    assert templated == full
    assert by_template == (1 if shape in FULL_PATH_SHAPES else 0)


@pytest.fixture
def worker_parent() -> Iterator[Any]:
    """A task a worker is running (what current_worker_task returns), for the duration."""
    add.push_request(
        id="parent-task-id",
        root_id="root-task-id",
        delivery_info={"priority": 4},
        called_directly=False,
    )
    _task_stack.push(add)
    try:
        yield add
    finally:
        _task_stack.pop()
        add.pop_request()


@pytest.mark.parametrize("inherit", [False, True])
def test_a_worker_tasks_children_match_too(
    inherit: bool, worker_parent: Any, monkeypatch: pytest.MonkeyPatch, built: Counter
) -> None:
    """Under a running task: root and parent ids, inherited priority, the parent's trail."""
    monkeypatch.setitem(app.conf, "task_inherit_parent_priority", inherit)
    templated, full, by_template = through_both_paths(
        lambda tid: add.apply_async((1, 2), task_id=tid), monkeypatch, built
    )
    assert templated == full
    assert by_template == 0
    assert '"parent_id": "parent-task-id"' in templated.options
    trail = [r.id for r in worker_parent.request.children]
    assert trail.count(templated.task_id) == 2  # the template call and the full path call


def test_group_members_match_and_come_from_one_template(
    monkeypatch: pytest.MonkeyPatch, built: Counter
) -> None:
    """A group's members (group id, index) are Celery's, built once per group shape."""
    collected: list[OutboxRow] = []
    with bulk() as collector:
        result = group(add.s(i, i) for i in range(4)).apply_async()
        collected = list(collector.rows)
        collector.rows.clear()
    assert built.built == 1
    monkeypatch.setattr(message_templates, "_publish_unobserved", lambda: False)
    for index, (row, member) in enumerate(zip(collected, result.results, strict=True)):
        again = written(
            lambda tid, i=index: add.apply_async(
                (i, i), task_id=tid, group_id=result.id, group_index=i
            ),
            member.id,
        )
        assert again == row


@pytest.mark.parametrize(
    ("first", "then"), [(0, None), (None, 3)], ids=["index-first", "none-first"]
)
def test_a_group_index_and_none_are_shapes_of_their_own(
    first: int | None, then: int | None, monkeypatch: pytest.MonkeyPatch, built: Counter
) -> None:
    """Two calls that differ only in having a group index never share a template."""
    group_id = "g-" + uuid.uuid4().hex  # a shape no other test built a template of

    def send(index: int | None) -> Send:
        return lambda tid: add.apply_async(
            (1, 2), task_id=tid, group_id=group_id, group_index=index
        )

    written(send(first), "first-" + uuid.uuid4().hex)  # the template of the first shape
    task_id = "same-" + uuid.uuid4().hex
    templated = written(send(then), task_id)
    with monkeypatch.context() as patch:
        patch.setattr(message_templates, "_publish_unobserved", lambda: False)
        full = written(send(then), task_id)
    assert templated == full


def test_a_publish_signal_receiver_sends_every_call_through_celery(built: Counter) -> None:
    """before_task_publish receivers see each message: the template path stands aside."""
    seen: list[str] = []

    def receiver(headers: dict[str, Any], **kwargs: Any) -> None:
        seen.append(headers["id"])

    celery_signals.before_task_publish.connect(receiver)
    try:
        rows = [
            written(lambda tid: add.apply_async((1, 2), task_id=tid), f"s-{n}") for n in range(3)
        ]
    finally:
        celery_signals.before_task_publish.disconnect(receiver)
    assert seen == [row.task_id for row in rows]
    assert built.built == 3


def _route_by_first_argument(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str]:
    return {"queue": f"q{args[0]}"}


def test_router_functions_and_sent_events_take_the_full_path(built: Counter) -> None:
    """A router function sees the arguments, task-sent events carry each message: no template."""
    routed = OutboxCelery("routed", set_as_current=False)
    routed.conf.update(task_routes=[_route_by_first_argument], broker_url="memory://")
    evented = OutboxCelery("evented", set_as_current=False)
    evented.conf.update(task_send_sent_event=True, broker_url="memory://")
    by_route = [
        written(lambda tid, n=n: routed.send_task("t", (n,), task_id=tid), f"r{n}")
        for n in range(3)
    ]
    for n in range(3):
        written(lambda tid, n=n: evented.send_task("t", (n,), task_id=tid), f"e{n}")
    assert built.built == 6
    assert [routing_key(row) for row in by_route] == ["q0", "q1", "q2"]


def test_configuration_changes_drop_the_templates(built: Counter) -> None:
    """Changing the app's configuration makes Celery build the next message again."""
    shaped = OutboxCelery("reconfigured", set_as_current=False)
    shaped.conf.update(broker_url="memory://", task_default_queue="before")
    first = [
        written(lambda tid: shaped.send_task("t", (1,), task_id=tid), f"c{n}") for n in range(2)
    ]
    shaped.conf.task_default_queue = "after"
    second = written(lambda tid: shaped.send_task("t", (1,), task_id=tid), "c-after")
    assert built.built == 2
    assert routing_key(first[1]) == "before"
    assert routing_key(second) == "after"
