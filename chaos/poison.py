"""Poison rows written straight into the outbox with SQL, and how each one must end.

| kind | what is wrong | the relay must |
|---|---|---|
| options-missing-headers | options `{}` | dead-letter it (undecodable) |
| options-not-object | options is a JSON string | dead-letter it (undecodable) |
| unknown-serializer | options name a serializer kombu does not have | spend its retries, then dead-letter it |
| future-schema | schema_version 99 | leave it untouched for a newer relay |
| unknown-task | a task name no worker knows | publish it (the worker discards it) |

(`options` is a `json` column, so text that is not JSON at all cannot be stored; these are the
rows that PostgreSQL accepts and the relay cannot use.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import psycopg
from django.db import connection, transaction

UNKNOWN_TASK = "chaos.no_such_task"
FUTURE_VERSION = 99

INSERT_SQL = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version)
VALUES (%(task_id)s, %(task_name)s, %(args)s::json, '{}'::json, %(options)s::json,
        %(schema_version)s)
"""
ROW_SQL = """
SELECT task_name, args::text, kwargs::text, options::text, context::text, schema_version,
       retries, retry_after, last_error
FROM outbox_notify_message_v1 WHERE task_id = %s
"""
DEAD_SQL = "SELECT failure_reason FROM outbox_notify_dead_letter_v1 WHERE task_id = %s"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Poison:
    """One poison row and the end it must come to."""

    kind: str
    task_id: str
    task_name: str
    options: str
    schema_version: int
    expect: str  # "dead:<reason substring>", "kept" or "published"


class _Capture(Exception):
    """Rolls back the transaction that captured a real message's options."""


def captured_options(queue: str) -> tuple[dict[str, Any], int]:
    """The options (and their schema_version) the write side stores for a message of an
    unknown task (rolled back)."""
    from chaos.celery_app import app

    captured: dict[str, Any] = {}
    version = 0
    try:
        with transaction.atomic():
            result = app.send_task(UNKNOWN_TASK, args=[1], queue=queue)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT options::text, schema_version FROM outbox_notify_message_v1"
                    " WHERE task_id = %s",
                    [result.id],
                )
                text, version = cursor.fetchone()
                captured.update(json.loads(text))
            raise _Capture
    except _Capture:
        pass
    return captured, version


def _with_id(options: dict[str, Any], task_id: str, **changes: Any) -> str:
    copy = json.loads(json.dumps(options))
    headers = copy.get("headers") or {}
    if "id" in headers:  # version 1's layout repeats the task id; the compact one does not
        headers["id"] = headers["root_id"] = task_id
        copy.setdefault("properties", {})["correlation_id"] = task_id
    copy.update(changes)
    return json.dumps(copy)


def make(scenario: str, queue: str) -> list[Poison]:
    """The poison rows of one scenario (task ids carry the scenario's name)."""
    template, version = captured_options(queue)

    def tid(kind: str) -> str:
        return f"poison-{scenario}-{kind}"

    return [
        Poison(kind="options-missing-headers", task_id=tid("options-missing-headers"),
               task_name="chaos.record", options="{}", schema_version=1,
               expect="dead:undecodable"),
        Poison(kind="options-not-object", task_id=tid("options-not-object"),
               task_name="chaos.record", options='"not an object"', schema_version=1,
               expect="dead:options is not a JSON object"),
        Poison(kind="unknown-serializer", task_id=tid("unknown-serializer"),
               task_name=UNKNOWN_TASK,
               options=_with_id(template, tid("unknown-serializer"), serializer="no-such"),
               schema_version=version, expect="dead:publish failed"),
        Poison(kind="future-schema", task_id=tid("future-schema"), task_name="chaos.record",
               options=_with_id(template, tid("future-schema")),
               schema_version=FUTURE_VERSION, expect="kept"),
        Poison(kind="unknown-task", task_id=tid("unknown-task"), task_name=UNKNOWN_TASK,
               options=_with_id(template, tid("unknown-task")), schema_version=version,
               expect="published"),
    ]  # fmt: skip


def insert(conn: psycopg.Connection[Any], rows: list[Poison]) -> dict[str, tuple[Any, ...]]:
    """Write the rows with plain SQL; return each row as stored, to compare later."""
    stored: dict[str, tuple[Any, ...]] = {}
    for row in rows:
        conn.execute(
            INSERT_SQL,
            {
                "task_id": row.task_id,
                "task_name": row.task_name,
                "args": "[1]",
                "options": row.options,
                "schema_version": row.schema_version,
            },
        )
        found = conn.execute(ROW_SQL, [row.task_id]).fetchone()
        stored[row.task_id] = tuple(found or ())
    return stored


def settled(conn: psycopg.Connection[Any], rows: list[Poison]) -> bool:
    """True once every row that must leave the outbox has left it."""
    for row in rows:
        if row.expect == "kept":
            continue
        if conn.execute(ROW_SQL, [row.task_id]).fetchone() is not None:
            return False
    return True


def verdicts(
    conn: psycopg.Connection[Any],
    rows: list[Poison],
    stored: dict[str, tuple[Any, ...]],
    worker_log: str,
) -> list[dict[str, Any]]:
    """How each row ended, against how it must end."""
    return [_verdict(conn, row, stored.get(row.task_id, ()), worker_log) for row in rows]


def _verdict(
    conn: psycopg.Connection[Any], row: Poison, stored: tuple[Any, ...], worker_log: str
) -> dict[str, Any]:
    current = conn.execute(ROW_SQL, [row.task_id]).fetchone()
    dead = conn.execute(DEAD_SQL, [row.task_id]).fetchone()
    if row.expect == "kept":
        ok = current is not None and tuple(current) == stored and dead is None
        observed = "untouched in the outbox" if ok else f"outbox={current!r} dead={dead!r}"
    elif row.expect == "published":
        discarded = row.task_id in worker_log and "unregistered task" in worker_log
        ok = current is None and dead is None and discarded
        observed = (
            "published; the worker discarded it as unregistered"
            if ok
            else f"outbox={current is not None} dead={dead!r} worker_saw={discarded}"
        )
    else:
        reason = dead[0] if dead else None
        ok = current is None and reason is not None and row.expect[5:] in reason
        observed = f"dead letter: {reason}" if reason else f"outbox={current!r}, no dead letter"
    return {"kind": row.kind, "expected": row.expect, "observed": observed[:300], "ok": ok}


def cleanup(conn: psycopg.Connection[Any], rows: list[Poison]) -> None:
    """Remove the kept row and the dead letters, so the next scenario starts clean."""
    ids = [row.task_id for row in rows]
    conn.execute("DELETE FROM outbox_notify_message_v1 WHERE task_id = ANY(%s)", [ids])
    conn.execute("DELETE FROM outbox_notify_dead_letter_v1 WHERE task_id = ANY(%s)", [ids])
