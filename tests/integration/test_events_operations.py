"""Events beside tasks in outbox_stats, the admin, the pytest plugin's fake relay and the signals."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from django.urls import reverse

from outbox_notify import events, signals
from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add
from tests.integration.test_admin import staff_client

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: signals fire on commit, and the stats run their own queries.


def _publish_mix() -> tuple[str, str]:
    """Two events of one type, one of another, and a task; returns the two types."""
    with transaction.atomic():
        for n in range(2):
            events.publish({"type": "shop.order.placed", "data": {"n": n}}, exchange="shop")
        events.publish({"type": "shop.order.paid", "data": {"card": "4111"}}, exchange="shop")
        add.delay(1, 2)
    return "shop.order.placed", "shop.order.paid"


def _dead_letter_one(event_type: str) -> None:
    """Move one event row to the dead letters as the relay would."""
    row = OutboxMessage.objects.filter(task_name=event_type).first()
    assert row is not None
    with connections["default"].cursor() as cur:
        cur.execute(
            "INSERT INTO outbox_notify_dead_letter_v1 (task_id, task_name, args, kwargs, options,"
            " context, schema_version, retries, failure_reason, created_at)"
            " SELECT task_id, task_name, args, kwargs, options, context, schema_version, 5,"
            " 'unroutable', created_at FROM outbox_notify_message_v1 WHERE id = %s",
            [row.id],
        )
    row.delete()


def test_stats_json_and_text_list_events_by_type_beside_tasks() -> None:
    """outbox_stats counts events in the figures and lists them by type, pending and dead."""
    placed, paid = _publish_mix()
    _dead_letter_one(paid)
    out = io.StringIO()
    call_command("outbox_stats", "--format", "json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["queue_depth"] == 3
    assert data["dead_letter_count"] == 1
    assert data["events"] == [
        {"type": placed, "pending": 2, "dead_letters": 0},
        {"type": paid, "pending": 0, "dead_letters": 1},
    ]
    assert data["exact"]["events"] is True
    text = io.StringIO()
    call_command("outbox_stats", stdout=text)
    assert "events by type:\n  shop.order.placed  pending=2 dead_letters=0\n" in text.getvalue()


def test_stats_text_without_events_has_no_events_lines() -> None:
    """With only tasks in the outbox, the text output is what it was before events existed."""
    add.delay(1, 2)
    out = io.StringIO()
    call_command("outbox_stats", stdout=out)
    assert "events" not in out.getvalue()


def mask_card(task_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that hides a `card` key, in task kwargs or in an event's data (args[0])."""
    shown = [{**a, "card": "****"} if isinstance(a, dict) and "card" in a else a for a in args]
    return shown, kwargs


@override_settings(OUTBOX_NOTIFY_REDACT="tests.integration.test_events_operations.mask_card")
def test_admin_lists_events_by_kind_with_redacted_data() -> None:
    """The changelist shows each row's kind, filters on it, sums events by type, and redacts
    an event's data through OUTBOX_NOTIFY_REDACT."""
    _publish_mix()
    client = staff_client("view_outboxmessage", "view_deadletter")
    url = reverse("admin:outbox_notify_outboxmessage_changelist")
    page = client.get(url, {"kind": "event"}).content.decode()
    assert page.count('<td class="field-kind">event</td>') == 3
    assert page.count('<td class="field-task_name">shop.order.placed</td>') == 2
    assert '<td class="field-task_name">tests.add</td>' not in page
    assert "4111" not in page
    assert "data={&quot;card&quot;: &quot;****&quot;}" in page
    assert "Event shop.order.placed" in page
    assert "2 pending, 0 dead letters" in page
    tasks = client.get(url, {"kind": "task"}).content.decode()
    assert tasks.count('<td class="field-kind">task</td>') == 1
    event = OutboxMessage.objects.filter(task_name="shop.order.paid").get()
    detail = client.get(reverse("admin:outbox_notify_outboxmessage_change", args=[event.id]))
    assert detail.status_code == 200
    assert "shop" in detail.content.decode()


def test_fake_relay_hands_over_events_as_envelopes(fake_relay: Any) -> None:
    """The pytest plugin's fake relay publishes events through the relay code as CloudEvents."""
    with transaction.atomic():
        sent = events.publish({"type": "shop.order.placed", "data": [1]}, exchange="shop")
        task_id = add.delay(1, 2).id
    published = {m.task_id: m for m in fake_relay.drain()}
    event = published[sent.id]
    assert event.event == sent
    assert (event.exchange, event.routing_key, event.args) == ("shop", "shop.order.placed", [])
    assert published[task_id].event is None
    assert published[task_id].args == [1, 2]


def test_drain_outbox_with_run_skips_events(drain_outbox: Any) -> None:
    """drain_outbox(run=True) runs tasks locally and passes events by (no task has their name)."""
    with transaction.atomic():
        events.publish({"type": "shop.order.placed"}, exchange="shop")
        add.delay(1, 2)
    assert {m.task_name for m in drain_outbox(run=True)} == {"shop.order.placed", "tests.add"}


def test_created_signal_fires_for_events_after_commit() -> None:
    """outbox_message_created fires for an event on commit: task_id is its id, task_name its type."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.outbox_message_created.connect(receiver, weak=False)
    try:
        with transaction.atomic():
            sent = events.publish({"type": "shop.order.placed"}, exchange="shop")
            assert seen == []
    finally:
        signals.outbox_message_created.disconnect(receiver)
    assert [(s["task_id"], s["task_name"]) for s in seen] == [(sent.id, "shop.order.placed")]
    assert not DeadLetter.objects.exists()


def test_dead_lettered_event_requeued_by_type_is_published_with_its_id(fake_relay: Any) -> None:
    """outbox_requeue_dead_letter --task-name <event type> brings an event back unchanged: the
    relay then publishes the same CloudEvent (same id, time and headers)."""
    with transaction.atomic():
        sent = events.publish({"type": "shop.order.paid", "data": {"n": 1}}, exchange="shop")
    _dead_letter_one("shop.order.paid")
    call_command(
        "outbox_requeue_dead_letter", "--task-name", "shop.order.paid", stdout=io.StringIO()
    )
    assert not DeadLetter.objects.exists()
    [message] = fake_relay.drain()
    assert message.event == sent
    assert message.headers["cloudEvents_id"] == sent.id
