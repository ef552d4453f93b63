"""The inbox of OnceTask: keys recorded in task bodies' transactions, their purge and stats.

`record()` runs as the first statement of a OnceTask body's transaction; everything else here
is for operators (`outbox_purge_inbox`, the `outbox_notify.purge_inbox` task, `outbox_stats`).
The queries are in `sql/inbox.sql`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, LiteralString

import psycopg
import structlog
from django.db import OperationalError
from psycopg import generators, pq

from outbox_notify import _compat as gates
from outbox_notify import _purging as purging
from outbox_notify import conf, stats
from outbox_notify import sql as sql_files
from outbox_notify._purging import PurgeResult
from outbox_notify._write import deferred, rows
from outbox_notify.exceptions import MarkedForRollback, OnceKeyError

log = structlog.get_logger("outbox_notify")

# characters, for a key and for a scope: both together stay under PostgreSQL's limit for one
# btree entry (about 2,700 bytes) even when every character takes four bytes in UTF-8.
MAX_KEY_LENGTH = 255
CHUNK_SIZE = 5_000  # keys deleted per purge transaction
SERIALIZATION_FAILURE = "40001"  # SQLSTATE
_IDLE = pq.TransactionStatus.IDLE
_INTRANS = pq.TransactionStatus.INTRANS
# psycopg's own wait loop for a query sent through libpq: used by psycopg for its statements
# but not documented, so a release without it makes record() send the key on its own.
_EXECUTE = getattr(generators, "execute", None)

__all__ = [
    "MAX_KEY_LENGTH",
    "InboxStats",
    "OnceKey",
    "PurgeResult",
    "checked_key",
    "require_commit",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OnceKey:
    """What a OnceTask delivery (or an event's handling) records: a key inside a scope.

    `derived` tells a key made by the task's `once_key` from one that is the task id.
    `former` is the key an earlier release recorded for the same delivery, if it recorded
    another: committed, it makes this delivery a duplicate too (record_key_unless_former).
    """

    scope: str
    key: str
    derived: bool
    former: str | None = None


class KeyConflict(Exception):
    """The key insert failed with a serialization failure (REPEATABLE READ or SERIALIZABLE).

    PostgreSQL raises it instead of doing nothing when the conflicting key was committed by a
    transaction this one's snapshot cannot see. The caller checks the key after rolling back.
    """


def checked_key(value: object, what: str) -> str:
    """`value` as a plain str fit to store as a key or scope; OnceKeyError naming `what` if not."""
    if not isinstance(value, str):
        raise OnceKeyError(
            f"{what} must be a str, got {type(value).__name__} {value!r:.80}; "
            "format other values into a string, e.g. f'order:{order_id}'"
        )
    text = value if type(value) is str else str.__str__(value)
    if not text or len(text) > MAX_KEY_LENGTH:
        raise OnceKeyError(
            f"{what} must have 1 to {MAX_KEY_LENGTH} characters, got {len(text)}: {text!r:.80}"
        )
    if "\x00" in text:
        raise OnceKeyError(f"{what} contains a NUL character, which PostgreSQL cannot store")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OnceKeyError(f"{what} is not valid Unicode text ({exc.reason})") from exc
    return text


def _without_comment_lines(query: LiteralString) -> LiteralString:
    """The query without its whole-line `--` comments, which would travel with every execution."""
    return "\n".join(line for line in query.splitlines() if not line.lstrip().startswith("--"))


@functools.cache
def queries() -> dict[str, LiteralString]:
    """The inbox queries of `sql/inbox.sql`, loaded once, without their comment lines.

    `record_key` runs in every OnceTask execution: its comment would triple what is sent.
    """
    named = sql_files.load("inbox.sql")
    return {name: _without_comment_lines(query) for name, query in named.items()}


def record(connection: Any, key: OnceKey, *, task_id: str, task_name: str) -> bool:
    """Insert the key on this Django connection; False when it is committed already.

    Waits while another open transaction holds the same key, then answers for the outcome.
    Called first in a transaction that has sent nothing yet, it sends `BEGIN` and the insert
    in one round trip (`_record_with_begin`); otherwise the insert goes alone.
    """
    params = {"scope": key.scope, "key": key.key, "task_id": task_id, "task_name": task_name}
    query = queries()["record_key"]
    if key.former is not None:
        params["former"] = key.former
        query = queries()["record_key_unless_former"]
    try:
        fused = _record_with_begin(connection, query, params)
        if fused is not None:
            return fused
        with connection.cursor() as cursor:
            cursor.execute(query, params)
            return bool(cursor.rowcount == 1)
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == SERIALIZATION_FAILURE:
            raise KeyConflict() from exc
        raise


def require_commit(connection: Any, what: str) -> None:
    """Raise MarkedForRollback when the transaction `what` ran in can only roll back.

    Called inside the atomic() block of a OnceTask delivery or an event's handling, after the
    body returned. A body that catches a database error (`except IntegrityError: pass`, or an
    error of a raw cursor, which leaves the transaction aborted) or calls
    `transaction.set_rollback(True)` returns normally, and atomic() then rolls back without
    raising (PostgreSQL turns the COMMIT of an aborted transaction into a ROLLBACK): the key
    and the effects would be gone while the delivery counted as done.
    """
    raw = connection.connection
    aborted = raw is not None and raw.info.transaction_status == pq.TransactionStatus.INERROR
    if connection.needs_rollback or aborted:
        raise MarkedForRollback(
            f"{what} returned but its transaction was marked for rollback (a database error "
            "caught inside it, or set_rollback(True)); nothing was committed"
        )


def _begin_command(raw: psycopg.Connection[Any]) -> str:
    """The BEGIN psycopg would send for this connection (its isolation, read-only, deferrable)."""
    parts = ["BEGIN"]
    if raw.isolation_level is not None:
        level = psycopg.IsolationLevel(raw.isolation_level).name.replace("_", " ")
        parts.append(f"ISOLATION LEVEL {level}")
    if raw.read_only is not None:
        parts.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        parts.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


@functools.cache
def _django_cursors() -> tuple[type, ...]:
    """The cursor classes Django's PostgreSQL backend gives psycopg (client or server binding)."""
    from django.db.backends.postgresql import base

    return (base.Cursor, base.ServerBindingCursor)


def _fusable(connection: Any) -> psycopg.Connection[Any] | None:
    """The psycopg connection when `BEGIN` may go with the key insert, else None.

    Only Django's own psycopg connection and cursors, in a transaction that has sent nothing
    yet, with nothing waiting to be written first, under a psycopg release the suite ran on,
    and where no one watches the statements at Django's level or at psycopg's (an instrumented
    cursor factory, a proxy around the connection). When it may not, the key goes alone, and
    `outbox.fused_begin_unavailable` says why (once per process and reason).
    """
    raw, reason = _fusable_or_why(connection)
    if reason is not None:
        _fallback(reason)
    return raw


def _fusable_or_why(connection: Any) -> tuple[psycopg.Connection[Any] | None, str | None]:
    """The psycopg connection and None, or None and why BEGIN may not go with the key."""
    if _EXECUTE is None:
        return None, "this psycopg has no generators.execute"
    problem = gates.psycopg_problem()
    if problem is None and rows.observed(connection):
        problem = (
            "something watches the connection's statements "
            "(query log, execute wrapper, instrumented cursor)"
        )
    if problem is not None:
        return None, problem
    rows.prepare(connection)
    raw = connection.connection
    problem = _raw_problem(raw) or _waiting_problem(connection)
    return (None, problem) if problem is not None else (raw, None)


def _raw_problem(raw: Any) -> str | None:
    if type(raw) is not psycopg.Connection or raw.cursor_factory not in _django_cursors():
        return "the connection or its cursors are not Django's own psycopg ones"
    if raw.autocommit or raw.pgconn.transaction_status != _IDLE:
        return "the transaction had sent statements before the key"
    if getattr(raw, "_pipeline", None) is not None:
        return "the connection is in pipeline mode"
    if raw.info.encoding != "utf-8":
        return f"the connection's encoding is {raw.info.encoding}, not utf-8"
    return None


def _waiting_problem(connection: Any) -> str | None:
    state = deferred.pending(connection)
    if state is not None and (state.rows or state.writing is not None):
        return "outbox rows were waiting to be written first"
    return None


_reported: set[str] = set()


def _fallback(reason: str) -> None:
    """Log, once per process and reason, that the key insert goes without BEGIN."""
    if reason in _reported:
        return
    _reported.add(reason)
    log.info("outbox.fused_begin_unavailable", reason=reason)


def _record_with_begin(connection: Any, query: str, params: dict[str, str]) -> bool | None:
    """`BEGIN; INSERT <key>` as one simple query; None where that cannot be done (`_fusable`).

    psycopg sends `BEGIN` before a transaction's first statement and waits for its answer, a
    round trip of its own. Sent together with the key insert instead, through the connection's
    libpq handle, the transaction starts exactly as psycopg would start it, and psycopg, which
    reads the transaction status from libpq, carries on inside it (the body's statements, then
    Django's COMMIT or ROLLBACK).
    """
    execute = _EXECUTE
    raw = _fusable(connection)
    if raw is None or execute is None:
        return None
    with connection.wrap_database_errors:
        insert = psycopg.ClientCursor(raw).mogrify(query, params)
        command = f"{_begin_command(raw)};\n{insert}".encode()
    with connection.wrap_database_errors, raw.lock:
        raw.pgconn.send_query(command)
        results = raw.wait(execute(raw.pgconn))
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding="utf-8")
        statuses = [pq.ExecStatus(result.status).name for result in results]
        if statuses != ["COMMAND_OK", "COMMAND_OK"] or raw.pgconn.transaction_status != _INTRANS:
            # Whatever happened, the caller's atomic() rolls back what there is to roll back.
            raise psycopg.InterfaceError(
                f"unexpected outcome of BEGIN and the key insert: {statuses}, "
                f"transaction status {pq.TransactionStatus(raw.pgconn.transaction_status).name}"
            )
        return bool(results[1].command_tuples == 1)


def owner(connection: Any, key: OnceKey) -> str | None:
    """The task id of the delivery that committed this key, None when it is not recorded."""
    with connection.cursor() as cursor:
        cursor.execute(queries()["key_owner"], {"scope": key.scope, "key": key.key})
        row = cursor.fetchone()
    return None if row is None else str(row[0])


# --- purge ------------------------------------------------------------------------------------


KEYS = purging.Target(
    queries=queries,
    plan="records_older_than_by_task",
    chunk="purge_records_chunk",
    event="outbox.inbox_purged",
)


def purge(
    older_than_days: int | None = None,
    *,
    dry_run: bool = False,
    chunk_size: int = CHUNK_SIZE,
    using: str | None = None,
) -> PurgeResult:
    """Delete keys older than N days (default: the retention setting), chunk by chunk."""
    days = conf.inbox_retention_days() if older_than_days is None else older_than_days
    alias = using or conf.database_alias()
    return purging.purge(KEYS, days, alias=alias, dry_run=dry_run, chunk_size=chunk_size)


# --- stats ------------------------------------------------------------------------------------


UNAVAILABLE = {
    "missing": "not installed: run `python manage.py migrate outbox_notify`",
    "denied": "not readable: this role needs SELECT on outbox_notify_inbox_v1",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InboxStats:
    """How many keys the inbox holds and how old the oldest is; None when it cannot be read."""

    records: int | None
    records_exact: bool
    oldest_seconds: float | None
    unavailable: str | None = None  # why there are no figures

    def as_dict(self) -> dict[str, Any]:
        """The figures under the keys `outbox_stats --format json` adds."""
        return {"inbox_records": self.records, "inbox_oldest_seconds": self.oldest_seconds}


def _scalar(cur: stats.Cursor, name: str, params: dict[str, Any] | None = None) -> Any:
    cur.execute(queries()[name], params)
    row = cur.fetchone()
    return None if row is None else row[0]


def _count(cur: stats.Cursor, limit: int) -> tuple[int, bool]:
    """Exact count while under `limit` keys, else the planner's estimate (never below limit)."""
    counted = int(_scalar(cur, "count_records_upto", {"limit": limit + 1}))
    if counted <= limit:
        return counted, True
    plan = _scalar(cur, "estimate_records")
    plan = json.loads(plan) if isinstance(plan, str | bytes) else plan
    return max(int(plan[0]["Plan"]["Plan Rows"]), counted), False


def collect_stats(connection: Any, *, exact_limit: int = stats.EXACT_LIMIT) -> InboxStats:
    """Count the inbox through a psycopg `Connection` or a Django connection."""
    with stats.cursor(connection) as cur:
        state = _scalar(cur, "inbox_readable")
        if state != "ok":
            return InboxStats(
                records=None,
                records_exact=True,
                oldest_seconds=None,
                unavailable=UNAVAILABLE[state],
            )
        records, exact = _count(cur, exact_limit)
        oldest = float(_scalar(cur, "oldest_record") or 0.0)
        return InboxStats(records=records, records_exact=exact, oldest_seconds=oldest)


def format_text(figures: InboxStats) -> str:
    """The inbox lines of `outbox_stats`' text form; estimates are marked with '~'."""
    if figures.records is None:
        return f"inbox_records          ({figures.unavailable})"
    mark = "" if figures.records_exact else "~"
    return (
        f"inbox_records          {mark}{figures.records}\n"
        f"inbox_oldest_seconds   {figures.oldest_seconds or 0.0:.1f}"
    )
