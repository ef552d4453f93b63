"""The admin through Django's test client: read-only pages, guarded actions, redaction."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client, override_settings
from django.urls import reverse

from outbox_notify.models import DeadLetter, OutboxMessage
from outbox_notify.relay.runner import connection_kwargs

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the actions must skip rows a relay holds, which a second connection can
# only lock once they are committed.

SECRET = "4111-1111-1111-1111"
OUTBOX_LIST = "admin:outbox_notify_outboxmessage_changelist"
DEAD_LIST = "admin:outbox_notify_deadletter_changelist"


def mask_card(task_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that hides the `card` kwarg."""
    return args, {**kwargs, "card": "****"}


def broken(task_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A redactor that always fails."""
    raise RuntimeError("no")


def add_message(task_name: str = "tests.charge", retries: int = 0, **kwargs: Any) -> OutboxMessage:
    """One outbox row through the ORM (retry_after set when retries > 0)."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version, retries, retry_after, last_error)"
            ' VALUES (%s, %s, \'[7]\', %s::json, \'{"headers": {}, "routing_key": "q1"}\', 1, %s,'
            " CASE WHEN %s > 0 THEN now() + interval '1 hour' END,"
            " CASE WHEN %s > 0 THEN 'ConnectionError: broker said no' END) RETURNING id",
            [str(uuid.uuid4()), task_name, json.dumps({"card": SECRET}), retries, retries, retries],
        )
        return OutboxMessage.objects.get(id=cur.fetchone()[0])


def add_dead_letter(task_name: str = "tests.charge") -> DeadLetter:
    """One dead letter."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "INSERT INTO outbox_notify_dead_letter_v1 (task_id, task_name, args, kwargs, options,"
            " schema_version, retries, failure_reason, created_at)"
            " VALUES (%s, %s, '[7]', %s::json, '{\"headers\": {}, \"relative\": {}}', 1, 5,"
            " 'gave up after 5 retries', now()) RETURNING id",
            [str(uuid.uuid4()), task_name, json.dumps({"card": SECRET})],
        )
        return DeadLetter.objects.get(id=cur.fetchone()[0])


def staff_client(*codenames: str) -> Client:
    """A test client logged in as a staff user holding exactly these permissions."""
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="outbox_notify", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    """A staff user allowed to view and act on both models."""
    return staff_client(
        "view_outboxmessage", "change_outboxmessage", "view_deadletter", "change_deadletter"
    )


@pytest.fixture
def viewer() -> Client:
    """A staff user allowed to view both models, but not to act on them."""
    return staff_client("view_outboxmessage", "view_deadletter")


@pytest.fixture
def relay_holds() -> Iterator[Any]:
    """Returns a function that locks outbox rows from another session, as a relay's claim does."""
    params = connection_kwargs("default")
    conn = psycopg.connect(**params, autocommit=False)

    def hold(row_id: int) -> None:
        conn.execute(
            "SELECT id FROM outbox_notify_message_v1 WHERE id = %s FOR UPDATE SKIP LOCKED",
            [row_id],
        )

    yield hold
    conn.rollback()
    conn.close()


def post_action(client: Client, url_name: str, action: str, ids: list[int]) -> Any:
    """Run a changelist action on these ids and follow the redirect."""
    return client.post(
        reverse(url_name),
        {"action": action, "_selected_action": [str(i) for i in ids]},
        follow=True,
    )


def messages_of(response: Any) -> list[str]:
    """The admin messages shown after an action."""
    return [str(m) for m in response.context["messages"]]


def test_changelist_shows_rows_and_the_summary_box(operator: Client) -> None:
    """The outbox changelist lists rows and, above them, depth, oldest age and dead letters."""
    add_message(retries=2)
    add_message()
    add_dead_letter()
    response = operator.get(reverse(OUTBOX_LIST))
    assert response.status_code == 200
    summary = response.context["outbox_summary"]
    assert (summary.queue_depth, summary.retrying, summary.dead_letter_count) == (2, 1, 1)
    html = response.content.decode()
    assert 'id="outbox-summary"' in html
    assert "ConnectionError: broker said no" in html


@override_settings(OUTBOX_NOTIFY_REDACT="tests.integration.test_admin.mask_card")
def test_arguments_are_redacted_in_list_and_detail(operator: Client) -> None:
    """Arguments go through the redactor on the list and on the object page."""
    row = add_message()
    dead = add_dead_letter()
    pages = [
        operator.get(reverse(OUTBOX_LIST)),
        operator.get(reverse("admin:outbox_notify_outboxmessage_change", args=[row.id])),
        operator.get(reverse(DEAD_LIST)),
        operator.get(reverse("admin:outbox_notify_deadletter_change", args=[dead.id])),
    ]
    for page in pages:
        html = page.content.decode()
        assert page.status_code == 200
        assert SECRET not in html
        assert "****" in html


def test_without_a_redactor_secret_looking_keys_are_masked_on_every_page(operator: Client) -> None:
    """No OUTBOX_NOTIFY_REDACT: a card number and a password never reach the admin's HTML."""
    row = add_message()
    with connections["default"].cursor() as cur:
        cur.execute(
            "UPDATE outbox_notify_message_v1 SET args = %s::json WHERE id = %s",
            [json.dumps([{"user": "ann", "password": "hunter2"}]), row.id],
        )
    dead = add_dead_letter()
    pages = [
        operator.get(reverse(OUTBOX_LIST)),
        operator.get(reverse("admin:outbox_notify_outboxmessage_change", args=[row.id])),
        operator.get(reverse(DEAD_LIST)),
        operator.get(reverse("admin:outbox_notify_deadletter_change", args=[dead.id])),
    ]
    for page in pages:
        html = page.content.decode()
        assert page.status_code == 200
        assert SECRET not in html
        assert "hunter2" not in html
        assert "kwargs={&quot;card&quot;: &quot;********&quot;}" in html
    assert "&quot;user&quot;: &quot;ann&quot;, &quot;password&quot;: &quot;********&quot;" in (
        pages[0].content.decode()
    )


@override_settings(OUTBOX_NOTIFY_REDACT="tests.integration.test_admin.broken")
def test_a_failing_redactor_shows_a_placeholder(operator: Client) -> None:
    """When the redactor raises, the page shows '<redaction failed>', never the values."""
    add_message()
    html = operator.get(reverse(OUTBOX_LIST)).content.decode()
    assert SECRET not in html
    assert "&lt;redaction failed&gt;" in html


def test_rows_cannot_be_added_changed_or_deleted_through_forms(operator: Client) -> None:
    """Even with every permission: no add page, a read-only object page, no delete action."""
    row = add_message(retries=3)
    change_url = reverse("admin:outbox_notify_outboxmessage_change", args=[row.id])
    assert operator.get(reverse("admin:outbox_notify_outboxmessage_add")).status_code == 403
    page = operator.get(change_url)
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert operator.post(change_url, {"retries": "0"}).status_code == 403
    delete_url = reverse("admin:outbox_notify_outboxmessage_delete", args=[row.id])
    assert operator.post(delete_url, {"post": "yes"}).status_code == 403
    choices = dict(
        operator.get(reverse(OUTBOX_LIST)).context["action_form"].fields["action"].choices
    )
    assert "delete_selected" not in choices
    assert OutboxMessage.objects.get(id=row.id).retries == 3


def test_reset_retries_skips_rows_a_relay_holds_and_logs_each_change(
    operator: Client, relay_holds: Any
) -> None:
    """Reset retries updates free rows only, reports the skipped ones and writes LogEntries."""
    free = [add_message(retries=4), add_message(retries=1)]
    held = add_message(retries=2)
    relay_holds(held.id)
    response = post_action(
        operator, OUTBOX_LIST, "reset_retries", [free[0].id, free[1].id, held.id]
    )
    assert messages_of(response) == [
        "Reset retries of 2 messages; skipped 1 (held by a relay right now, already published, "
        "or held until their ETA: use Cancel to remove those)."
    ]
    for row in free:
        row.refresh_from_db()
        assert (row.retries, row.retry_after) == (0, None)
    held.refresh_from_db()
    assert held.retries == 2
    assert held.retry_after is not None
    entries = LogEntry.objects.filter(action_flag=CHANGE)
    assert sorted(int(str(e.object_id)) for e in entries) == sorted(r.id for r in free)
    assert {e.change_message for e in entries} == {"Reset retries (admin action)."}


def test_reset_retries_needs_the_change_permission(viewer: Client) -> None:
    """A user without the change permission is not offered the action and cannot run it."""
    row = add_message(retries=3)
    page = viewer.get(reverse(OUTBOX_LIST))
    assert page.status_code == 200
    assert page.context["action_form"] is None  # its only action needs the permission
    post_action(viewer, OUTBOX_LIST, "reset_retries", [row.id])
    row.refresh_from_db()
    assert row.retries == 3
    assert not LogEntry.objects.exists()


def test_requeue_moves_dead_letters_back_and_logs_each(operator: Client) -> None:
    """The requeue action moves the selected dead letters to the outbox and logs each one."""
    chosen, other = add_dead_letter(), add_dead_letter("tests.other")
    response = post_action(operator, DEAD_LIST, "requeue", [chosen.id])
    assert messages_of(response) == [
        "Requeued 1 dead letters; skipped 0 (held by another requeue or purge right now, or "
        "already gone)."
    ]
    assert list(DeadLetter.objects.values_list("id", flat=True)) == [other.id]
    requeued = OutboxMessage.objects.get()
    assert (requeued.task_id, requeued.retries) == (chosen.task_id, 0)
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.action_flag) == (str(chosen.id), CHANGE)


def test_requeue_needs_the_change_permission(viewer: Client) -> None:
    """Without the change permission the requeue action does nothing."""
    dead = add_dead_letter()
    post_action(viewer, DEAD_LIST, "requeue", [dead.id])
    assert DeadLetter.objects.filter(id=dead.id).exists()
    assert not OutboxMessage.objects.exists()
    assert not LogEntry.objects.exists()


def test_search_by_exact_task_id_and_filters(operator: Client) -> None:
    """Search finds a row by its exact task id; the task-name and retries filters narrow."""
    wanted = add_message("tests.a", retries=6)
    add_message("tests.b", retries=1)
    add_message("tests.a")

    def listed(**query: str) -> set[int]:
        page = operator.get(reverse(OUTBOX_LIST), query)
        assert page.status_code == 200
        return {row.id for row in page.context["cl"].result_list}

    assert listed(q=wanted.task_id) == {wanted.id}
    assert listed(q=wanted.task_id[:8]) == set()
    assert len(listed(task_name="tests.a")) == 2
    assert listed(retries="5+") == {wanted.id}
    assert listed(task_name="tests.a", retries="0") != listed(task_name="tests.a")


def test_the_admin_index_links_to_the_dashboard_for_who_may_view_the_outbox(
    viewer: Client,
) -> None:
    """The index and the app page show "Outbox dashboard" to staff who may view outbox
    messages; following it reaches the dashboard."""
    entry = reverse("admin:outbox_notify_outboxdashboard_changelist")
    for page in (reverse("admin:index"), reverse("admin:app_list", args=["outbox_notify"])):
        body = viewer.get(page).content.decode()
        assert f'href="{entry}"' in body
        assert "Outbox dashboard" in body
    response = viewer.get(entry, follow=True)
    assert response.redirect_chain == [(reverse("admin:outbox_notify_dashboard"), 302)]
    assert response.status_code == 200
    assert "Outbox dashboard" in response.content.decode()


def test_the_dashboard_entry_is_hidden_from_who_may_not_view_the_outbox() -> None:
    """Staff with only the dead letters' permission see no entry, and its URL refuses them."""
    client = staff_client("view_deadletter")
    entry = reverse("admin:outbox_notify_outboxdashboard_changelist")
    assert entry not in client.get(reverse("admin:index")).content.decode()
    assert client.get(entry).status_code == 403
