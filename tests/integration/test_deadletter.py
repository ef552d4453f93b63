"""Dead-letter purge and requeue (commands, core and Celery task) against a real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import structlog
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings

from outbox_notify import deadletter
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.models import DeadLetter, OutboxMessage
from outbox_notify.relay.runner import connection_kwargs
from tests.celery_app import add, app
from tests.command_support import run_command

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: purge and requeue commit chunk by chunk, and several tests hold row locks
# from a second connection, which only sees committed rows.

INSERT_DEAD = """
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retries,
     failure_reason, created_at, dead_at)
VALUES (%s, %s, %s::json, '{"k": "v"}', %s::json, '{"structlog": {"request_id": "r-1"}}', 1,
        5, 'boom', now() - interval '2 days', now() - make_interval(secs => %s * 86400))
RETURNING id
"""
MOVE_TO_DEAD_LETTERS = """
WITH gone AS (DELETE FROM outbox_notify_message_v1 RETURNING *)
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retries,
     failure_reason, created_at, dead_at)
SELECT task_id, task_name, args, kwargs, options, context, schema_version, 5, 'boom',
       created_at, now() - interval '1 day'
FROM gone
RETURNING id
"""
PLAIN_OPTIONS = '{"headers": {"id": "x", "task": "t"}, "relative": {}}'


def add_dead_letter(
    task_name: str = "tests.add",
    *,
    days_ago: float = 0.0,
    options: str = PLAIN_OPTIONS,
    args: str = "[1, 2]",
) -> int:
    """Insert one dead letter that died `days_ago` days ago; return its id."""
    with connections["default"].cursor() as cur:
        cur.execute(INSERT_DEAD, [str(uuid.uuid4()), task_name, args, options, days_ago])
        return int(cur.fetchone()[0])


def kill_outbox_rows() -> list[int]:
    """Move every outbox row to the dead letters, as the relay does after its last retry."""
    with connections["default"].cursor() as cur:
        cur.execute(MOVE_TO_DEAD_LETTERS)
        return [int(row[0]) for row in cur.fetchall()]


def stored_text(table: str, column: str) -> list[str]:
    """The exact stored JSON text of one column of a table, in id order."""
    queries = {
        ("outbox", "options"): "SELECT options::text FROM outbox_notify_message_v1 ORDER BY id",
        ("outbox", "args"): "SELECT args::text FROM outbox_notify_message_v1 ORDER BY id",
        ("dead", "options"): "SELECT options::text FROM outbox_notify_dead_letter_v1 ORDER BY id",
    }
    with connections["default"].cursor() as cur:
        cur.execute(queries[(table, column)])
        return [row[0] for row in cur.fetchall()]


def run(command: str, *args: str) -> tuple[str, str]:
    """Run a management command in-process; return (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    call_command(command, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def lock_dead_letter() -> Iterator[Any]:
    """Returns a function that locks one dead letter from another session until the test ends."""
    params = connection_kwargs("default")
    conn = psycopg.connect(**params, autocommit=False)

    def lock(dead_letter_id: int) -> None:
        conn.execute(
            "SELECT id FROM outbox_notify_dead_letter_v1 WHERE id = %s FOR UPDATE",
            [dead_letter_id],
        )

    yield lock
    conn.rollback()
    conn.close()


# --- purge -------------------------------------------------------------------------------


def test_purge_dry_run_reports_per_task_name_and_deletes_nothing() -> None:
    """--dry-run prints what would go, grouped by task name with counts, and deletes nothing."""
    add_dead_letter("tests.a", days_ago=40)
    add_dead_letter("tests.a", days_ago=41)
    add_dead_letter("tests.b", days_ago=50)
    add_dead_letter("tests.b", days_ago=1)
    out, _ = run("outbox_purge_dead_letter", "--older-than-days", "30", "--dry-run")
    assert "would delete 3 dead letters" in out
    assert "         2  tests.a" in out
    assert "         1  tests.b" in out
    assert DeadLetter.objects.count() == 4


def test_purge_deletes_only_older_rows_chunk_by_chunk() -> None:
    """Purge deletes every row past the cut-off, in chunks of --chunk-size, and keeps the rest."""
    old = [add_dead_letter(days_ago=40 + n) for n in range(5)]
    kept = add_dead_letter(days_ago=29)
    with structlog.testing.capture_logs() as logs:
        out, _ = run("outbox_purge_dead_letter", "--older-than-days", "30", "--chunk-size", "2")
    assert "deleted 5 dead letters" in out
    assert "(3 chunks)" in out
    assert list(DeadLetter.objects.values_list("id", flat=True)) == [kept]
    assert not DeadLetter.objects.filter(id__in=old).exists()
    events = [e for e in logs if e["event"] == "outbox.dead_letters_purged"]
    assert [(e["deleted"], e["chunks"], e["older_than_days"]) for e in events] == [(5, 3, 30)]


@override_settings(OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS=10)
def test_purge_defaults_to_the_retention_setting() -> None:
    """Without --older-than-days the purge uses OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS."""
    add_dead_letter("tests.old", days_ago=15)
    add_dead_letter("tests.young", days_ago=5)
    run("outbox_purge_dead_letter")
    assert list(DeadLetter.objects.values_list("task_name", flat=True)) == ["tests.young"]


def test_purge_skips_rows_another_session_holds(lock_dead_letter: Any) -> None:
    """A dead letter locked elsewhere is skipped without waiting; the others are deleted."""
    held = add_dead_letter(days_ago=40)
    add_dead_letter(days_ago=40)
    lock_dead_letter(held)
    result = deadletter.purge(30)
    assert result.deleted == 1
    assert list(DeadLetter.objects.values_list("id", flat=True)) == [held]


def test_purge_celery_task_is_registered_and_purges() -> None:
    """outbox_notify.purge_dead_letters is a Celery task (for beat) running the same purge."""
    import outbox_notify.tasks  # noqa: F401 - what app.autodiscover_tasks() imports

    add_dead_letter(days_ago=40)
    add_dead_letter(days_ago=1)
    task = app.tasks["outbox_notify.purge_dead_letters"]
    assert task.apply(kwargs={"older_than_days": 30}).get() == 1
    assert DeadLetter.objects.count() == 1


# --- requeue -----------------------------------------------------------------------------


def test_requeue_by_id_moves_rows_back_fresh_and_byte_exact() -> None:
    """Requeued rows get retries 0, no retry_after, created_at now; their JSON text is kept."""
    first = add_dead_letter(args='[1, "a\\u0000b"]')
    add_dead_letter()
    before = stored_text("dead", "options")[0]
    out, _ = run("outbox_requeue_dead_letter", "--id", str(first))
    assert "requeued 1 dead letters" in out
    row = OutboxMessage.objects.get()
    assert (row.retries, row.retry_after, row.last_error) == (0, None, None)
    assert (dt.datetime.now(dt.UTC) - row.created_at).total_seconds() < 60
    assert row.kwargs == {"k": "v"}
    assert row.context == {"structlog": {"request_id": "r-1"}}
    assert stored_text("outbox", "args") == ['[1, "a\\u0000b"]']
    assert stored_text("outbox", "options") == [before]
    assert not DeadLetter.objects.filter(id=first).exists()
    assert DeadLetter.objects.count() == 1


def test_requeue_by_task_name_moves_only_that_task() -> None:
    """--task-name moves every dead letter of that name and no other."""
    add_dead_letter("tests.a")
    add_dead_letter("tests.b")
    add_dead_letter("tests.a")
    run("outbox_requeue_dead_letter", "--task-name", "tests.a")
    assert sorted(OutboxMessage.objects.values_list("task_name", flat=True)) == [
        "tests.a",
        "tests.a",
    ]
    assert list(DeadLetter.objects.values_list("task_name", flat=True)) == ["tests.b"]


def test_requeue_all_in_chunks_keeps_the_original_order() -> None:
    """--all moves everything chunk by chunk; outbox ids follow the dead letters' order."""
    names = [f"tests.t{n}" for n in range(5)]
    for name in names:
        add_dead_letter(name)
    out, _ = run("outbox_requeue_dead_letter", "--all", "--chunk-size", "2")
    assert "requeued 5 dead letters" in out
    assert list(OutboxMessage.objects.order_by("id").values_list("task_name", flat=True)) == names
    assert DeadLetter.objects.count() == 0


def test_requeue_rebases_relative_countdown_and_expires() -> None:
    """A message sent with countdown/expires gets eta and expires counted from the requeue."""
    with transaction.atomic():
        add.apply_async((1, 2), countdown=30, expires=300)
    kill_outbox_rows()
    with connections["default"].cursor() as cur:  # it died long ago: its old times are past
        cur.execute(
            "UPDATE outbox_notify_dead_letter_v1 SET options = replace(options::text,"
            " %s, '2000-01-01T')::json",
            [dt.datetime.now(dt.UTC).date().isoformat() + "T"],
        )
    run("outbox_requeue_dead_letter", "--all")
    headers = OutboxMessage.objects.get().options["headers"]
    now = dt.datetime.now(dt.UTC)
    eta = dt.datetime.fromisoformat(headers["eta"])
    expires = dt.datetime.fromisoformat(headers["expires"])
    assert 20 <= (eta - now).total_seconds() <= 31
    assert 290 <= (expires - now).total_seconds() <= 301


def test_requeue_warns_about_absolute_expiry_already_past_but_still_requeues() -> None:
    """An absolute expires in the past is kept (no relative value to re-base) and counted."""
    expired = json.dumps({"headers": {"expires": "2001-01-01T00:00:00+00:00"}, "relative": {}})
    add_dead_letter(options=expired)
    add_dead_letter()
    with structlog.testing.capture_logs() as logs:
        out, err = run("outbox_requeue_dead_letter", "--all")
    assert "requeued 2 dead letters" in out
    assert "warning: 1 of them carry an absolute expiry that has already passed" in err
    assert OutboxMessage.objects.count() == 2
    assert [e["count"] for e in logs if e["event"] == "outbox.requeued_already_expired"] == [1]


def test_requeue_dry_run_reports_and_moves_nothing() -> None:
    """--dry-run prints the counts per task name and leaves both tables as they were."""
    add_dead_letter("tests.a")
    add_dead_letter("tests.a")
    out, _ = run("outbox_requeue_dead_letter", "--all", "--dry-run")
    assert "would requeue 2 dead letters" in out
    assert "         2  tests.a" in out
    assert (OutboxMessage.objects.count(), DeadLetter.objects.count()) == (0, 2)


def test_requeue_skips_rows_another_session_holds(lock_dead_letter: Any) -> None:
    """A dead letter locked elsewhere stays; the command says how many ids it could not move."""
    held = add_dead_letter()
    free = add_dead_letter()
    lock_dead_letter(held)
    out, err = run("outbox_requeue_dead_letter", "--id", str(held), str(free))
    assert "requeued 1 dead letters" in out
    assert "1 of the given ids were not found or are locked" in err
    assert list(DeadLetter.objects.values_list("id", flat=True)) == [held]


@pytest.mark.parametrize(
    "args",
    [(), ("--all", "--task-name", "tests.a"), ("--id", "1", "--all")],
    ids=["none", "all-and-name", "id-and-all"],
)
def test_requeue_requires_exactly_one_selector(args: tuple[str, ...]) -> None:
    """Zero or two of --id/--task-name/--all is an error, and nothing moves."""
    add_dead_letter()
    with pytest.raises(CommandError):
        run("outbox_requeue_dead_letter", *args)
    assert DeadLetter.objects.count() == 1


def test_selector_rejects_ambiguous_choices() -> None:
    """The core refuses a selector naming zero or several selections."""
    with pytest.raises(ConfigurationError):
        deadletter.Selector()
    with pytest.raises(ConfigurationError):
        deadletter.Selector(ids=(1,), everything=True)


def test_purge_rejects_a_negative_age() -> None:
    """--older-than-days below 0 is a usage error naming the flag, and nothing is deleted."""
    add_dead_letter(days_ago=40)
    with pytest.raises(CommandError, match="argument --older-than-days: must be at least 0"):
        run("outbox_purge_dead_letter", "--older-than-days", "-1")
    assert DeadLetter.objects.count() == 1


# -- what the commands print: stdout the report only, progress only on a terminal -------------


def test_purge_prints_only_its_report_on_stdout_and_no_progress_outside_a_terminal(
    subprocess_env: dict[str, Any],
) -> None:
    """Under cron (no TTY) stdout is the one report line; log lines go to stderr, no progress."""
    for _ in range(5):
        add_dead_letter(days_ago=3)
    ran = run_command(
        subprocess_env, "outbox_purge_dead_letter", "--older-than-days", "1", "--chunk-size", "2"
    )
    assert ran.returncode == 0, ran.stderr
    [line] = ran.stdout.splitlines()
    assert line.startswith("deleted 5 dead letters that died before "), ran.stdout
    assert line.endswith("(3 chunks)"), ran.stdout
    assert "outbox.dead_letters_purged" in ran.stderr
    assert "\r" not in ran.stderr
    assert "deleting dead letters" not in ran.stderr


def test_requeue_prints_only_its_report_on_stdout(subprocess_env: dict[str, Any]) -> None:
    """The requeue's stdout is its own report; the log event goes to stderr."""
    for name in ("tests.add", "tests.add", "tests.other"):
        add_dead_letter(name)
    ran = run_command(subprocess_env, "outbox_requeue_dead_letter", "--all")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "requeued 3 dead letters",
        "           2  tests.add",
        "           1  tests.other",
    ]
    assert "outbox.dead_letters_requeued" in ran.stderr


@pytest.mark.parametrize("command", ["outbox_purge_dead_letter", "outbox_requeue_dead_letter"])
def test_on_a_terminal_a_long_purge_or_requeue_shows_its_progress_on_stderr(
    subprocess_env: dict[str, Any], command: str
) -> None:
    """stderr on a TTY gets a progress line redrawn in place; stdout keeps the bare report."""
    for _ in range(4):
        add_dead_letter(days_ago=3)
    chosen = ("--older-than-days", "1") if command == "outbox_purge_dead_letter" else ("--all",)
    ran = run_command(subprocess_env, command, *chosen, "--chunk-size", "1", tty=True)
    assert ran.returncode == 0, ran.stderr
    label = "deleting dead letters" if command == "outbox_purge_dead_letter" else "requeueing"
    assert re.search(rf"\r\x1b\[K{label}[^\r]*: 1\b", ran.stderr), repr(ran.stderr)
    assert "\r" not in ran.stdout
    assert label not in ran.stdout
    assert ran.stdout.split()[0] in {"deleted", "requeued"}
