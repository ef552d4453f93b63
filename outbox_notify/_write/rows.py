"""Writes outbox rows on the outbox alias, in the caller's transaction: one, or many at once.

Both paths run on Django's connection for the alias, so they share the caller's transaction
(and roll back with it). Inside atomic() a single row waits for the caller's next statement
or COMMIT and is written with the others (deferred.py). The single INSERT skips Django's
cursor wrapper when nothing observes queries (no execute wrappers but the outbox's, no query
log, no instrumentation patched in), making the same checks it would make; otherwise it goes
through `connection.cursor()` as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import structlog
from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from outbox_notify import observability, signals
from outbox_notify import sql as sql_files
from outbox_notify._write import deferred
from outbox_notify.serialization import OutboxRow


def _copy_holds_the_connection(version: str) -> bool:
    """Whether psycopg's `cursor.copy()` keeps the connection's lock until the COPY ends
    (3.3 and later; 3.2 releases it once the COPY has started, so another statement of the
    same connection could reach the server in the middle of it)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (3, 3)


# A bulk block's full batches are written on a writer thread only where nothing else can
# reach the connection while the COPY runs (deferred.py also waits for it before every
# statement that goes through Django).
BACKGROUND_COPY = _copy_holds_the_connection(psycopg.__version__)

log = structlog.get_logger("outbox_notify")

_DJANGO_EXECUTE = CursorWrapper.execute


def insert_row(row: OutboxRow, alias: str, app: Any) -> None:
    """Store one row on `alias`, in the caller's transaction when there is one.

    Inside atomic() the row waits for the caller's next statement or COMMIT (deferred.py);
    otherwise it is inserted now.
    """
    connection = connections[alias]
    if not deferred.for_connection(connection, write_rows).add(row):
        deferred.flush(connection)  # rows enqueued earlier go first
        _warn_outside_transaction(connection, app, row, count=1)
        try:
            _insert_one(connection, row)
        except DatabaseError as exc:
            deferred.explain(exc, alias)
            raise
    _announce(connection, (row,))


def insert_rows(
    rows: Sequence[OutboxRow], alias: str, app: Any, *, background: bool = False
) -> None:
    """Insert many rows on `alias` with one COPY (one round trip), in the caller's transaction.

    With `background` inside atomic(), the COPY runs on a writer thread and this returns as
    soon as it holds the connection; the connection's next statement, COMMIT or rollback
    waits for it and raises what it raised (deferred.py).
    """
    if not rows:
        return
    connection = connections[alias]
    deferred.flush(connection)  # rows enqueued earlier go first
    _warn_outside_transaction(connection, app, rows[0], count=len(rows))
    if (
        background
        and BACKGROUND_COPY
        and connection.in_atomic_block
        and deferred.available(connection)
    ):
        _copy_in_background(connection, rows)  # its errors surface through deferred.py
    else:
        try:
            _copy(connection, rows)
        except DatabaseError as exc:
            deferred.explain(exc, alias)
            raise
    _announce(connection, rows)


def write_rows(connection: BaseDatabaseWrapper, rows: Sequence[OutboxRow]) -> None:
    """Write rows a transaction deferred: one INSERT for one row, one COPY for more."""
    if len(rows) == 1:
        _insert_one(connection, rows[0])
    else:
        _copy(connection, rows)


def _insert_one(connection: BaseDatabaseWrapper, row: OutboxRow) -> None:
    _execute(
        connection,
        sql_files.queries()["insert_message"],
        {
            "task_id": row.task_id,
            "task_name": row.task_name,
            "args": row.args,
            "kwargs": row.kwargs,
            "options": row.options,
            "context": row.context,
            "schema_version": row.schema_version,
            "retry_after": row.hold_until,
        },
    )


def _copy(connection: BaseDatabaseWrapper, rows: Sequence[OutboxRow]) -> None:
    prepare(connection)
    data = "".join(map(_copy_line, rows))
    with (
        connection.wrap_database_errors,
        connection.connection.cursor() as cursor,
        cursor.copy(sql_files.queries()["copy_messages"]) as copy,
    ):
        copy.write(data)


def _copy_in_background(connection: BaseDatabaseWrapper, rows: Sequence[OutboxRow]) -> None:
    prepare(connection)
    data = "".join(map(_copy_line, rows))
    raw = connection.connection
    query = sql_files.queries()["copy_messages"]

    def work(holding: Callable[[], None]) -> None:
        with raw.cursor() as cursor, cursor.copy(query) as copy:
            holding()  # cursor.copy() holds the psycopg connection's lock until the COPY ends
            copy.write(data)

    deferred.for_connection(connection, write_rows).start(len(rows), work)


# COPY's text format: a backslash starts an escape, tab and newline end a field or a line.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


_FIELDS = 6  # the text columns before schema_version


def _copy_line(row: OutboxRow) -> str:
    """One row in COPY text format (psycopg's write_row does the same, per value, slower)."""
    line = "\t".join((row.task_id, row.task_name, row.args, row.kwargs, row.options, row.context))
    # Usually nothing needs escaping: no backslash, newline or carriage return anywhere, and
    # no tab but the separators. Four scans of the line cost less than escaping each field.
    if "\\" in line or "\n" in line or "\r" in line or line.count("\t") != _FIELDS - 1:
        line = _escaped_line(row)
    return line + _copy_end(row)


def _escaped_line(row: OutboxRow) -> str:
    # The JSON columns hold kombu's ASCII JSON: no tab, newline or carriage return can occur
    # in them (JSON escapes those), so doubling the backslashes is the whole escaping.
    return "\t".join(
        (
            row.task_id.translate(_COPY_ESCAPES),
            row.task_name.translate(_COPY_ESCAPES),
            row.args.replace("\\", "\\\\"),
            row.kwargs.replace("\\", "\\\\"),
            row.options.replace("\\", "\\\\"),
            row.context.replace("\\", "\\\\"),
        )
    )


def _copy_end(row: OutboxRow) -> str:
    """The last two fields: schema_version, and retry_after (NULL: ready now; else the ETA a
    task is held until, whose isoformat needs no escape)."""
    if row.hold_until is None:
        return f"\t{row.schema_version}\t\\N\n"
    return f"\t{row.schema_version}\t{row.hold_until.isoformat()}\n"


def in_worker_task(app: Any) -> bool:
    """Whether this call comes from a task a Celery worker is running right now."""
    return app is not None and app.current_worker_task is not None


def _warn_outside_transaction(
    connection: BaseDatabaseWrapper, app: Any, row: OutboxRow, *, count: int
) -> None:
    # A web request that enqueues in autocommit has lost the outbox's point (the task can
    # run before, or without, the request's own writes): warn. A task that a worker's task
    # enqueues (chain steps, callbacks, chord bodies, fan-out from a task body) runs in
    # autocommit by design: Celery itself sends those after the task body returned.
    if connection.in_atomic_block or not connection.get_autocommit() or in_worker_task(app):
        return
    log.warning(
        "outbox.enqueue_outside_transaction",
        task_name=row.task_name,
        task_id=row.task_id,
        count=count,
        database=connection.alias,
    )


def observed(connection: BaseDatabaseWrapper) -> bool:
    """Whether something watches this connection's statements: then they go through Django.

    Query logging (DEBUG, assertNumQueries), a user's execute wrapper, or a patched
    CursorWrapper (APM agents) must see every statement, so the shortcuts of the write side
    and of OnceTask's key insert are off while one of them is there.
    """
    return (
        any(not deferred.is_ours(w) for w in connection.execute_wrappers)
        or connection.queries_logged
        or CursorWrapper.execute is not _DJANGO_EXECUTE
    )


def prepare(connection: BaseDatabaseWrapper) -> None:
    """What Django's connection.cursor() and CursorWrapper check before a statement."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()


def _execute(connection: BaseDatabaseWrapper, query: str, params: dict[str, Any]) -> None:
    if observed(connection):
        with connection.cursor() as cursor:
            cursor.execute(query, params)
        return
    prepare(connection)
    with connection.wrap_database_errors, connection.connection.cursor() as cursor:
        cursor.execute(query, params)


def _announce(connection: BaseDatabaseWrapper, rows: Sequence[OutboxRow]) -> None:
    signal = signals.outbox_message_created
    if not signal.receivers or not signal.has_listeners(sender=signals.SENDER):
        return
    for row in rows:
        transaction.on_commit(
            functools.partial(
                observability.send_signal,
                signal,
                task_id=row.task_id,
                task_name=row.task_name,
            ),
            using=connection.alias,
        )
