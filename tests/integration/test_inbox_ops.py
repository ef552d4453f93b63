"""The inbox for operators: outbox_purge_inbox, the purge task, outbox_stats, the admin page."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import structlog
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import Client, override_settings
from django.urls import reverse
from psycopg import sql as pgsql

from outbox_notify import inbox
from outbox_notify.models import InboxRecord
from outbox_notify.relay.runner import connection_kwargs
from tests.celery_app import app

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the purge commits chunk by chunk, one test holds rows from a second
# session (which sees committed rows only), and stats read planner estimates of committed rows.

INSERT_KEY = """
INSERT INTO outbox_notify_inbox_v1 (scope, key, task_id, task_name, created_at)
VALUES (%s, %s, %s, %s, now() - make_interval(secs => %s * 86400))
RETURNING id
"""
INBOX_LIST = "admin:outbox_notify_inboxrecord_changelist"


def add_key(task_name: str = "tests.a", *, days_ago: float = 0.0, key: str | None = None) -> int:
    """Record one key as if a OnceTask body had committed it `days_ago` days ago."""
    task_id = str(uuid.uuid4())
    with connections["default"].cursor() as cur:
        cur.execute(INSERT_KEY, [task_name, key or task_id, task_id, task_name, days_ago])
        return int(cur.fetchone()[0])


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_purge_dry_run_reports_per_task_name_and_deletes_nothing() -> None:
    """--dry-run prints what would go, by task name, and deletes nothing."""
    add_key("tests.a", days_ago=40)
    add_key("tests.a", days_ago=41)
    add_key("tests.b", days_ago=50)
    add_key("tests.b", days_ago=1)
    out = run("outbox_purge_inbox", "--older-than-days", "30", "--dry-run")
    assert "would delete 3 inbox keys recorded before" in out
    assert "         2  tests.a" in out
    assert "         1  tests.b" in out
    assert InboxRecord.objects.count() == 4


def test_purge_deletes_only_older_keys_chunk_by_chunk() -> None:
    """Every key past the cut-off goes, --chunk-size per transaction; younger ones stay."""
    for n in range(5):
        add_key(days_ago=40 + n)
    kept = add_key(days_ago=29)
    with structlog.testing.capture_logs() as logs:
        out = run("outbox_purge_inbox", "--older-than-days", "30", "--chunk-size", "2")
    assert "deleted 5 inbox keys" in out
    assert "(3 chunks)" in out
    assert list(InboxRecord.objects.values_list("id", flat=True)) == [kept]
    events = [e for e in logs if e["event"] == "outbox.inbox_purged"]
    assert [(e["deleted"], e["chunks"], e["older_than_days"]) for e in events] == [(5, 3, 30)]


@override_settings(OUTBOX_NOTIFY_INBOX_RETENTION_DAYS=10)
def test_purge_defaults_to_the_retention_setting() -> None:
    """Without --older-than-days the purge uses OUTBOX_NOTIFY_INBOX_RETENTION_DAYS."""
    add_key("tests.old", days_ago=15)
    add_key("tests.young", days_ago=5)
    run("outbox_purge_inbox")
    assert list(InboxRecord.objects.values_list("task_name", flat=True)) == ["tests.young"]


def test_purge_keeps_thirty_days_by_default() -> None:
    """The default retention is 30 days, as long as dead letters may wait to be requeued."""
    add_key("tests.old", days_ago=31)
    add_key("tests.young", days_ago=29)
    run("outbox_purge_inbox")
    assert list(InboxRecord.objects.values_list("task_name", flat=True)) == ["tests.young"]


@pytest.mark.parametrize("args", [["--older-than-days", "-1"], ["--chunk-size", "0"]])
def test_purge_refuses_bad_values(args: list[str]) -> None:
    """A negative age or an empty chunk is a usage error naming the flag; nothing deleted."""
    add_key(days_ago=40)
    with pytest.raises(CommandError, match=f"argument {args[0]}: must be at least"):
        run("outbox_purge_inbox", *args)
    assert InboxRecord.objects.count() == 1


@override_settings(OUTBOX_NOTIFY_INBOX_RETENTION_DAYS="a week")
def test_an_invalid_retention_setting_is_reported() -> None:
    """The setting is validated like the others (system check E004 and at use)."""
    from outbox_notify import conf

    assert "OUTBOX_NOTIFY_INBOX_RETENTION_DAYS" in [name for name, _ in conf.problems()]
    with pytest.raises(CommandError, match="INBOX_RETENTION_DAYS"):
        run("outbox_purge_inbox")


@pytest.fixture
def hold_key() -> Iterator[Any]:
    """Locks an inbox row from another session, as a concurrent purge does."""
    conn = psycopg.connect(**connection_kwargs("default"), autocommit=False)

    def hold(row_id: int) -> None:
        conn.execute("SELECT id FROM outbox_notify_inbox_v1 WHERE id = %s FOR UPDATE", [row_id])

    yield hold
    conn.rollback()
    conn.close()


def test_purge_skips_keys_another_purge_holds(hold_key: Any) -> None:
    """Two purges at once never wait for each other: held rows are skipped."""
    held = add_key(days_ago=40)
    add_key(days_ago=40)
    hold_key(held)
    assert inbox.purge(30).deleted == 1
    assert list(InboxRecord.objects.values_list("id", flat=True)) == [held]


def test_purge_celery_task_is_registered_and_purges() -> None:
    """outbox_notify.purge_inbox is a Celery task (for beat) running the same purge."""
    import outbox_notify.tasks  # noqa: F401 - what app.autodiscover_tasks() imports

    add_key(days_ago=40)
    add_key(days_ago=1)
    assert app.tasks["outbox_notify.purge_inbox"].apply(kwargs={"older_than_days": 30}).get() == 1
    assert InboxRecord.objects.count() == 1


# --- stats ------------------------------------------------------------------------------------


def test_stats_json_counts_the_inbox() -> None:
    """outbox_stats --format json adds inbox_records and inbox_oldest_seconds (and exactness)."""
    empty = json.loads(run("outbox_stats", "--format", "json"))
    assert (empty["inbox_records"], empty["inbox_oldest_seconds"]) == (0, 0.0)
    add_key(days_ago=2)
    add_key()
    data = json.loads(run("outbox_stats", "--format", "json"))
    assert data["inbox_records"] == 2
    assert 2 * 86400 - 60 < data["inbox_oldest_seconds"] < 2 * 86400 + 60
    assert data["exact"]["inbox_records"] is True
    assert "queue_depth" in data


def test_stats_text_lists_the_inbox() -> None:
    """The text form has the inbox lines just before the top_failing list that ends it."""
    add_key(days_ago=1)
    text = run("outbox_stats")
    assert "\ninbox_records          1\ninbox_oldest_seconds   86" in text
    assert text.index("inbox_oldest_seconds") < text.index("top_failing")


def test_inbox_count_is_estimated_past_the_exact_limit() -> None:
    """Beyond exact_limit rows the count is the planner's estimate, marked as such."""
    for _ in range(12):
        add_key()
    with connections["default"].cursor() as cur:
        cur.execute("ANALYZE outbox_notify_inbox_v1")
    figures = inbox.collect_stats(connections["default"], exact_limit=5)
    assert figures.records is not None
    assert figures.records >= 6
    assert not figures.records_exact
    assert inbox.format_text(figures).startswith("inbox_records          ~")


def test_stats_for_a_role_that_cannot_read_the_inbox_report_nothing_instead_of_failing() -> None:
    """A monitoring role granted SELECT before the inbox existed: outbox_stats still exits 0."""
    role = f"outbox_ops_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(**connection_kwargs("default"), autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE ROLE {} NOLOGIN").format(pgsql.Identifier(role)))
        try:
            admin.execute(
                pgsql.SQL(
                    "GRANT SELECT ON outbox_notify_message_v1, outbox_notify_dead_letter_v1 TO {}"
                ).format(pgsql.Identifier(role))
            )
            with psycopg.connect(**connection_kwargs("default")) as conn:
                conn.execute(pgsql.SQL("SET ROLE {}").format(pgsql.Identifier(role)))
                figures = inbox.collect_stats(conn)
        finally:
            admin.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
            admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
    assert (figures.records, figures.oldest_seconds) == (None, None)
    assert "needs SELECT on outbox_notify_inbox_v1" in inbox.format_text(figures)


def test_stats_before_the_inbox_migration_report_nothing_instead_of_failing() -> None:
    """A database not yet migrated to 0002: outbox_stats still works (probes keep passing)."""
    params = connection_kwargs("default")
    with psycopg.connect(**params, autocommit=False) as conn:
        conn.execute("DROP TABLE outbox_notify_inbox_v1")
        figures = inbox.collect_stats(conn)
        conn.rollback()
    assert (figures.records, figures.oldest_seconds) == (None, None)
    assert "not installed" in inbox.format_text(figures)


# --- admin ------------------------------------------------------------------------------------


@pytest.fixture
def viewer() -> Client:
    """A staff user allowed to view inbox records (and holding every other inbox permission)."""
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="outbox_notify", codename__contains="inbox"
        )
    )
    client = Client()
    client.force_login(user)
    return client


def test_admin_lists_keys_and_finds_them_by_exact_key(viewer: Client) -> None:
    """The changelist shows scope, key, task and when; search matches a key exactly."""
    add_key("tests.confirm", key="order:17")
    add_key("tests.confirm", key="order:18")
    page = viewer.get(reverse(INBOX_LIST))
    assert page.status_code == 200
    html = page.content.decode()
    assert "order:17" in html
    assert "order:18" in html
    found = viewer.get(reverse(INBOX_LIST), {"q": "order:17"})
    assert [r.key for r in found.context["cl"].result_list] == ["order:17"]
    filtered = viewer.get(reverse(INBOX_LIST), {"task_name": "tests.confirm"})
    assert len(filtered.context["cl"].result_list) == 2


def test_admin_cannot_add_change_or_delete_keys(viewer: Client) -> None:
    """Read-only even with every permission: deleting a key would let a duplicate run."""
    row = add_key(key="order:17")
    change_url = reverse("admin:outbox_notify_inboxrecord_change", args=[row])
    assert viewer.get(reverse("admin:outbox_notify_inboxrecord_add")).status_code == 403
    page = viewer.get(change_url)
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert viewer.post(change_url, {"key": "x"}).status_code == 403
    delete_url = reverse("admin:outbox_notify_inboxrecord_delete", args=[row])
    assert viewer.post(delete_url, {"post": "yes"}).status_code == 403
    assert viewer.get(reverse(INBOX_LIST)).context["action_form"] is None
    assert InboxRecord.objects.get(id=row).key == "order:17"
