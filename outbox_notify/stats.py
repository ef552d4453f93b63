"""Health figures of the outbox, cheap enough to poll on tables of millions of rows.

`collect()` runs a handful of bounded queries from `sql/ops.sql`: counts are exact while a
LIMITed count stays under `exact_limit` rows and planner estimates beyond that, and
`OutboxStats.exact` says which is which. Row-level "in flight" counts are not observable
without locking rows; `claims_open` (relay transactions holding a claimed batch) times the
relay's batch size bounds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import psycopg
from psycopg.rows import tuple_row

from outbox_notify import held
from outbox_notify import sql as sql_files
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.store import QueueGauges, SnapshotHolder, gauges_from
from outbox_notify.serialization import EVENT_VERSION, SCHEMA_VERSION

EXACT_LIMIT = 10_000  # rows: a LIMITed count reads at most this many before estimating
FAILING_WINDOW = 10_000  # rows: failing outbox rows and recent dead letters top_failing reads
DEFAULT_TOP = 5  # task names in top_failing (and event types in events)
DEFAULT_EVENT_TYPES = 10  # event types the admin's summary lists


class Cursor(Protocol):
    """The part of a DB-API cursor (psycopg's or Django's) the stats queries use."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, query: str, params: Any = None, /) -> Any: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FailingTask:
    """One task name's recent failures: rows awaiting a retry, dead letters, retries spent."""

    task_name: str
    failing: int
    dead_letters: int
    retries: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EventType:
    """Domain events of one type: rows waiting in the outbox, and dead letters."""

    type: str
    pending: int
    dead_letters: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OutboxStats:
    """A snapshot of the outbox's health; `exact` says which counts are estimates."""

    queue_depth: int
    due_now: int
    retrying: int
    dead_letter_count: int
    oldest_pending_seconds: float
    top_failing: tuple[FailingTask, ...]
    notify_queue_usage: float
    relays_listening: int
    claims_open: int
    oldest_claim_seconds: float
    exact: Mapping[str, bool]
    # Rows held until an ETA still ahead (counted in queue_depth, not in due_now).
    scheduled: held.Scheduled
    # Domain events by type (outbox_notify.events), most numerous first; counted in the
    # figures above too, where an event is one more message.
    events: tuple[EventType, ...] = ()
    # Rows deleted or updated that vacuum has not removed yet, and the oldest snapshot that
    # keeps it from removing them (None when there is none this role may see).
    dead_rows: int = 0
    oldest_snapshot: SnapshotHolder | None = None
    # How many of the dead rows a vacuum had to leave: dead_rows beyond the rows inserted since
    # the table's last vacuum (the rest only wait for autovacuum's next round).
    dead_rows_held: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as JSON-ready data (the `outbox_stats --format json` document)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["top_failing"] = [dataclasses.asdict(task) for task in self.top_failing]
        data["exact"] = dict(self.exact)
        data["scheduled"] = held.as_json(self.scheduled)
        data["events"] = [dataclasses.asdict(event) for event in self.events]
        holder = self.oldest_snapshot
        data["oldest_snapshot"] = None if holder is None else dataclasses.asdict(holder)
        return data


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Count:
    """A row count and whether it is exact or the planner's estimate."""

    value: int
    exact: bool


def queries() -> sql_files.Queries:
    """The operator queries of `sql/ops.sql`, loaded once."""
    return sql_files.load("ops.sql")


@contextlib.contextmanager
def cursor(connection: Any) -> Iterator[Cursor]:
    """A cursor on a psycopg connection or a Django connection, in a transaction of its own
    (a savepoint inside the caller's), so settings made with set_config(..., true) hold for
    its statements and no longer."""
    if isinstance(connection, psycopg.Connection):
        # A transaction block so a non-autocommit connection is not left idle in transaction.
        with connection.transaction(), connection.cursor(row_factory=tuple_row) as cur:
            yield cur
    else:
        from django.db import transaction

        with transaction.atomic(using=connection.alias), connection.cursor() as cur:
            yield cur


def frontier_params(cur: Cursor) -> dict[str, Any]:
    """Where the newest frontier a relay saved stands, as query parameters (see _pending).

    Without one (no relay has run yet) the reads start at the beginning of each index.
    """
    frontier = Frontier()
    cur.execute(sql_files.queries()["load_frontier"], {"max_version": SCHEMA_VERSION})
    [(state, xmax, now)] = cur.fetchall()  # one row, a frontier saved or not
    frontier.load(state)  # a json column: psycopg has decoded it
    frontier.check(int(xmax), float(now))
    return frontier.params()


def scalar(cur: Cursor, name: str, params: Mapping[str, Any] | None = None) -> Any:
    """Run named query `name` and return the first column of its first row (None if no row)."""
    cur.execute(queries()[name], params)
    row = cur.fetchone()
    return None if row is None else row[0]


def planner_rows(cur: Cursor, name: str) -> int:
    """The planner's row estimate from a named `EXPLAIN (FORMAT JSON)` query."""
    plan = scalar(cur, name)
    if isinstance(plan, str | bytes):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


def bounded_count(
    cur: Cursor,
    count_query: str,
    estimate_query: str,
    limit: int,
    params: Mapping[str, Any] | None = None,
) -> Count:
    """Exact count when under `limit` rows, else the planner's estimate (never below limit)."""
    counted = int(scalar(cur, count_query, {**(params or {}), "limit": limit + 1}))
    if counted <= limit:
        return Count(value=counted, exact=True)
    return Count(value=max(planner_rows(cur, estimate_query), counted), exact=False)


def _text(value: str | bytes) -> str:
    """A text column's value as str, whatever the server's encoding."""
    # psycopg hands back bytes from a SQL_ASCII database; task names are UTF-8 there too.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def top_failing(cur: Cursor, top: int, window: int) -> tuple[tuple[FailingTask, ...], bool]:
    """The `top` task names with most retries, and whether the figures cover every row."""
    if top <= 0:
        return (), True
    cur.execute(queries()["top_failing"], {"top": top, "window": window})
    rows = cur.fetchall()
    tasks = tuple(
        FailingTask(task_name=_text(name), failing=int(f), dead_letters=int(d), retries=int(r))
        for name, f, d, r, _ in rows
    )
    return tasks, not any(row[4] for row in rows)


def events_by_type(
    cur: Cursor, top: int, window: int, frontier: Mapping[str, Any]
) -> tuple[tuple[EventType, ...], bool]:
    """The `top` event types with most rows, and whether the figures cover every row."""
    if top <= 0:
        return (), True
    params = {**frontier, "top": top, "window": window, "version": EVENT_VERSION}
    cur.execute(queries()["events_by_type"], params)
    rows = cur.fetchall()
    found = tuple(
        EventType(type=_text(name), pending=int(p), dead_letters=int(d)) for name, p, d, _ in rows
    )
    return found, not any(row[3] for row in rows)


def relay_sessions(cur: Cursor) -> tuple[int, int, float]:
    """(relays listening, claim transactions open, age in seconds of the oldest claim)."""
    cur.execute(queries()["relay_sessions"])
    listening, claims, oldest = cur.fetchone()
    return int(listening), int(claims), float(oldest)


def collect(
    connection: Any,
    *,
    top: int = DEFAULT_TOP,
    exact_limit: int = EXACT_LIMIT,
    failing_window: int = FAILING_WINDOW,
    event_types: int | None = None,
) -> OutboxStats:
    """Take a stats snapshot through a psycopg `Connection` or a Django connection.

    `top` bounds top_failing, and the event types too unless `event_types` says otherwise.
    """
    with cursor(connection) as cur:
        cur.execute(queries()["plan_like_the_relay"])
        frontier = frontier_params(cur)
        depth = bounded_count(
            cur, "count_messages_upto", "estimate_messages", exact_limit, frontier
        )
        retrying = bounded_count(cur, "count_retrying_upto", "estimate_retrying", exact_limit)
        dead = bounded_count(cur, "count_dead_letters_upto", "estimate_dead_letters", exact_limit)
        failing, failing_exact = top_failing(cur, top, failing_window)
        types = top if event_types is None else event_types
        by_type, events_exact = events_by_type(
            cur, types, failing_window, {**frontier, "limit": exact_limit}
        )
        listening, claims, oldest_claim = relay_sessions(cur)
        scheduled = held.scheduled(cur, exact_limit)
        oldest = scalar(
            cur, "oldest_pending", {**frontier, "limit": exact_limit, "window": exact_limit}
        )
        horizon = vacuum_horizon(cur)
        return OutboxStats(
            queue_depth=depth.value,
            due_now=max(depth.value - retrying.value - scheduled.count, 0),
            retrying=retrying.value,
            dead_letter_count=dead.value,
            oldest_pending_seconds=float(oldest or 0.0),
            top_failing=failing,
            notify_queue_usage=float(scalar(cur, "notify_queue_usage")),
            relays_listening=listening,
            claims_open=claims,
            oldest_claim_seconds=oldest_claim,
            exact={
                "queue_depth": depth.exact,
                "due_now": depth.exact and retrying.exact and scheduled.exact,
                "retrying": retrying.exact,
                "dead_letter_count": dead.exact,
                "top_failing": failing_exact,
                "events": events_exact,
            },
            scheduled=scheduled,
            events=by_type,
            dead_rows=horizon.dead_rows,
            oldest_snapshot=horizon.holder,
            dead_rows_held=horizon.dead_rows_held,
        )


def vacuum_horizon(cur: Cursor) -> QueueGauges:
    """The outbox's dead rows, how many of them a snapshot holds back, and the oldest snapshot
    keeping vacuum from removing them (the gauges' vacuum fields; the others are zero)."""
    cur.execute(queries()["vacuum_horizon"])
    return gauges_from((0, None, None, *cur.fetchone()))


def format_text(stats: OutboxStats) -> str:
    """The snapshot as aligned lines for a terminal; estimates are marked with '~'."""

    def mark(name: str) -> str:
        return "" if stats.exact.get(name, True) else "~"

    lines = [
        f"queue_depth            {mark('queue_depth')}{stats.queue_depth}",
        f"due_now                {mark('due_now')}{stats.due_now}",
        f"retrying               {mark('retrying')}{stats.retrying}",
        f"oldest_pending_seconds {stats.oldest_pending_seconds:.1f}",
        f"dead_letter_count      {mark('dead_letter_count')}{stats.dead_letter_count}",
        f"notify_queue_usage     {stats.notify_queue_usage:.4f}",
        f"relays_listening       {stats.relays_listening}",
        f"claims_open            {stats.claims_open}",
        f"oldest_claim_seconds   {stats.oldest_claim_seconds:.1f}",
        f"dead_rows              {stats.dead_rows}",
        f"dead_rows_held         {stats.dead_rows_held}",
        f"oldest_snapshot        {holder_text(stats.oldest_snapshot)}",
        *held.as_text(stats.scheduled),
        *_events_text(stats),
        f"top_failing{' (sample)' if mark('top_failing') else ''}:",
    ]
    lines += [
        f"  {t.task_name}  retries={t.retries} failing={t.failing} dead_letters={t.dead_letters}"
        for t in stats.top_failing
    ] or ["  (none)"]
    return "\n".join(lines)


def holder_text(holder: SnapshotHolder | None) -> str:
    """The oldest snapshot holding dead rows back, as one line (or 'none visible')."""
    if holder is None:
        return "none visible"
    held_for = "" if holder.seconds is None else f" for {holder.seconds:.0f} s"
    pid = "" if holder.pid is None else f" pid {holder.pid}"
    return f"{holder.kind}{pid} {holder.name!r}{held_for}, {holder.xids} transactions old"


def _events_text(stats: OutboxStats) -> list[str]:
    """Lines for domain events by type; none at all while there are none (tasks only)."""
    if not stats.events:
        return []
    sample = " (sample)" if not stats.exact.get("events", True) else ""
    return [
        f"events by type{sample}:",
        *(f"  {e.type}  pending={e.pending} dead_letters={e.dead_letters}" for e in stats.events),
    ]
