"""manage.py outbox_list against a real PostgreSQL: states, filters, redaction, cost, progress."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings

from outbox_notify import listing
from outbox_notify.stats import queries
from tests.command_support import run_command

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the progress test runs the command as a subprocess, which sees only
# committed rows.

INSERT = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, retry_after,
     last_error, created_at)
VALUES (%s, %s, %s::json, %s::json, '{}', 1, %s, now() + make_interval(secs => %s),
        %s, now() - make_interval(secs => %s))
RETURNING id
"""
INSERT_DEAD = """
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, failure_reason,
     created_at, dead_at)
VALUES (%s, %s, '[1]', '{"card": "4111"}', '{}', 1, 5, %s, now() - interval '1 day',
        now() - make_interval(secs => %s))
RETURNING id
"""


def row(
    task_id: str,
    task_name: str = "tests.add",
    *,
    retries: int = 0,
    due_in: float | None = None,
    error: str | None = None,
    age: float = 0.0,
    kwargs: str = "{}",
) -> int:
    """One outbox row: ready (no due_in), held (due_in, no error) or retrying (error)."""
    with connection.cursor() as cur:
        cur.execute(INSERT, [task_id, task_name, "[1, 2]", kwargs, retries, due_in, error, age])
        return int(cur.fetchone()[0])


def dead(
    task_id: str, task_name: str = "tests.add", *, reason: str = "boom", age: float = 0
) -> int:
    """One dead letter that died `age` seconds ago."""
    with connection.cursor() as cur:
        cur.execute(INSERT_DEAD, [task_id, task_name, reason, age])
        return int(cur.fetchone()[0])


def listed(*argv: str) -> list[dict[str, Any]]:
    """outbox_list's JSON output for these flags."""
    out = io.StringIO()
    call_command("outbox_list", *argv, "--format", "json", stdout=out, stderr=io.StringIO())
    return list(json.loads(out.getvalue()))


def ids(*argv: str) -> list[str]:
    return [r["task_id"] for r in listed(*argv)]


def test_each_state_lists_its_own_rows() -> None:
    """pending = ready or retrying; held = waiting for an ETA, soonest first; dead = dead letters."""
    row("ready")
    row("retrying", retries=1, due_in=60, error="Timeout")
    row("held-later", due_in=7200)
    row("held-sooner", due_in=3600)
    dead("dead-one")
    assert ids("--state", "pending") == ["ready", "retrying"]
    assert ids("--state", "held") == ["held-sooner", "held-later"]
    assert ids("--state", "dead") == ["dead-one"]


def test_filters_by_task_name_age_and_error_text() -> None:
    """--task-name exact, --older-than on created_at (dead: dead_at), --error-contains any case."""
    row("old", age=600)
    row("new", age=1)
    row("other-task", "tests.other", age=600)
    row("timed-out", retries=2, due_in=30, error="ConnectionError: Read TIMEOUT", age=600)
    dead("died-long-ago", reason="KeyError: x", age=7200)
    dead("died-now", reason="Timeout after 10 s", age=1)
    assert ids("--task-name", "tests.add", "--older-than", "300") == ["old", "timed-out"]
    assert ids("--error-contains", "timeout") == ["timed-out"]
    assert ids("--state", "dead", "--older-than", "3600") == ["died-long-ago"]
    assert ids("--state", "dead", "--error-contains", "TIMEOUT") == ["died-now"]


def test_limit_holds_across_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 2 rows: --limit 5 gives the 5 oldest, in order, of 7; held pages follow the ETA."""
    monkeypatch.setattr(listing, "PAGE_SIZE", 2)
    for i in range(7):
        row(f"r{i}")
        row(f"h{i}", due_in=1000 - i)
    assert ids("--limit", "5") == [f"r{i}" for i in range(5)]
    assert ids("--state", "held") == [f"h{i}" for i in reversed(range(7))]


@override_settings(OUTBOX_NOTIFY_REDACT="tests.integration.test_admin.mask_card")
def test_arguments_are_shown_through_the_redactor_in_both_formats() -> None:
    """The admin's redactor decides what is shown; the raw card number never is."""
    row("paid", kwargs='{"card": "4111111111111111", "amount": 5}')
    dead("died")
    [shown] = listed()
    assert "4111" not in shown["arguments"]
    assert '"amount": 5' in shown["arguments"]
    out = io.StringIO()
    call_command("outbox_list", "--state", "dead", stdout=out)
    header, line = out.getvalue().splitlines()
    assert header.split() == [
        "id", "task_name", "task_id", "retries", "created_at", "dead_at", "error", "arguments",
    ]  # fmt: skip
    assert "died" in line
    assert "4111" not in line


@pytest.mark.parametrize("name", ["list_pending_page", "list_held_page", "list_dead_page"])
def test_each_query_reads_an_index_in_its_order_without_sorting(name: str) -> None:
    """With sequential scans and sorts priced out, each page query still has a plan: one that
    walks an index in the listing's order (cheap with LIMIT on a table of millions)."""
    params = {"task_name": None, "cutoff": None, "error": None, "after": 0, "page": 100}
    params["after_at"] = listing._EPOCH
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("SET LOCAL enable_sort = off")
        cur.execute("EXPLAIN " + queries()[name], params)
        plan = "\n".join(line for (line,) in cur.fetchall())
    assert "Index Scan" in plan, plan
    assert "Seq Scan" not in plan, plan
    # Held rows: the index orders by retry_after; an incremental sort only orders the ties by
    # id, a page at a time. A full sort of the table would be a "Sort" node.
    nodes = [line.strip().removeprefix("->  ") for line in plan.splitlines()]
    assert not [node for node in nodes if node.startswith("Sort  (")], plan


def test_on_a_terminal_a_long_listing_shows_progress_and_stdout_stays_the_table(
    subprocess_env: dict[str, Any],
) -> None:
    """A --limit past PROGRESS_FROM draws a progress line on a TTY's stderr, none in a pipe."""
    for i in range(3):
        row(f"t{i}")
    limit = str(listing.PAGE_SIZE * 5)
    on_tty = run_command(subprocess_env, "outbox_list", "--limit", limit, tty=True)
    assert on_tty.returncode == 0, on_tty.stderr
    assert "\r\x1b[Kreading rows: [" in on_tty.stderr, repr(on_tty.stderr)
    assert on_tty.stdout.splitlines()[0].split()[:2] == ["id", "task_name"]
    assert len(on_tty.stdout.splitlines()) == 4
    piped = run_command(subprocess_env, "outbox_list", "--limit", limit)
    assert piped.returncode == 0, piped.stderr
    assert "reading rows" not in piped.stderr
    assert piped.stdout == on_tty.stdout.replace("\r\n", "\n")
