"""Tasks held in the outbox until their ETA: the write-side decision, the figures, cancelling.

A task whose ETA is further ahead than OUTBOX_NOTIFY_HOLD_ETA_AFTER is stored like any other
row, with its ETA in `retry_after`. Every relay, including releases that know nothing of
holding, claims a row only once `retry_after` has passed and sets its timer for the next one,
so the message (Celery's own, `eta` header included) reaches the broker at its ETA instead of
waiting hours in a broker queue and a worker's memory. A held row is one never tried:
`retry_after` set, `retries = 0`, `last_error` NULL (see sql/install.sql).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog
from billiard.common import TERM_SIGNAME
from celery.app.control import Control
from django.db import connections, transaction

from outbox_notify import serialization
from outbox_notify import sql as sql_files

log = structlog.get_logger("outbox_notify")


def queries() -> sql_files.Queries:
    """The named queries of `sql/held.sql`, loaded once."""
    return sql_files.load("held.sql")


# -- the write side ------------------------------------------------------------------------


def eta_of(value: Any) -> dt.datetime | None:
    """The `eta` header as an aware datetime, read as the worker reads it (a naive one is UTC,
    whatever the app's timezone); None when there is none or it cannot be read.
    """
    if not value:
        return None
    try:
        return serialization.header_time(value)
    except (TypeError, ValueError):
        return None


def hold_until(
    headers: Mapping[str, Any],
    threshold: float | None,
    now: dt.datetime | None = None,
) -> dt.datetime | None:
    """The ETA to hold a message until, or None to let the relay publish it at once."""
    if threshold is None or not headers.get("eta"):
        return None
    eta = eta_of(headers["eta"])
    if eta is None:
        return None
    ahead = (eta - (now or dt.datetime.now(dt.UTC))).total_seconds()
    return eta if ahead > threshold else None


# -- the figures (outbox_stats, admin) -------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Scheduled:
    """Rows held until an ETA that has not come yet: how many, and when the next falls due."""

    count: int
    exact: bool  # False: count is the planner's estimate (more than the exact limit)
    next_due_at: dt.datetime | None
    next_due_in: float | None  # seconds from now, on the database's clock


def scheduled(cur: Any, exact_limit: int) -> Scheduled:
    """Count held rows (exactly up to `exact_limit`) and find the next one due, cheaply."""
    cur.execute(queries()["count_held_upto"], {"limit": exact_limit + 1})
    counted = int(cur.fetchone()[0])
    exact = counted <= exact_limit
    count = counted
    if not exact:
        cur.execute(queries()["estimate_held"])
        count = max(counted, _plan_rows(cur.fetchone()[0]))
    cur.execute(queries()["next_held"])
    row = cur.fetchone()
    next_at, next_in = (row[0], float(row[1])) if row else (None, None)
    return Scheduled(count=count, exact=exact, next_due_at=next_at, next_due_in=next_in)


def _plan_rows(plan: Any) -> int:
    if isinstance(plan, str | bytes):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


def as_json(section: Scheduled) -> dict[str, Any]:
    """The `scheduled` section of `outbox_stats --format json`."""
    return {
        "count": section.count,
        "exact": section.exact,
        "next_due_at": section.next_due_at.isoformat() if section.next_due_at else None,
        "next_due_in_seconds": section.next_due_in,
    }


def as_text(section: Scheduled) -> list[str]:
    """The lines of the `scheduled` section of `outbox_stats` (text)."""
    mark = "" if section.exact else "~"
    due = "-"
    if section.next_due_at is not None and section.next_due_in is not None:
        due = f"{section.next_due_at.isoformat()} (in {section.next_due_in:.1f}s)"
    return [f"scheduled              {mark}{section.count}", f"scheduled_next_due     {due}"]


# -- cancelling (AsyncResult.revoke(), the admin action) -----------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cancelled:
    """One outbox row removed before a relay published it."""

    id: int
    task_id: str
    task_name: str
    held: bool  # it was waiting for its ETA
    ignore_result: bool


def cancel_tasks(task_ids: Iterable[str], *, alias: str, app: Any = None) -> list[Cancelled]:
    """Remove the unpublished outbox rows of these task ids (see `cancel`)."""
    ids = [str(task_id) for task_id in task_ids]
    if not ids:
        return []
    return _cancel("cancel_by_task_ids", {"task_ids": ids}, alias=alias, app=app)


def cancel_rows(row_ids: Sequence[int], *, alias: str, app: Any = None) -> list[Cancelled]:
    """Remove these outbox rows by id (see `cancel`)."""
    if not row_ids:
        return []
    return _cancel("cancel_by_ids", {"ids": list(row_ids)}, alias=alias, app=app)


def _cancel(query: str, params: dict[str, Any], *, alias: str, app: Any) -> list[Cancelled]:
    """Delete rows no relay holds, in the caller's transaction on `alias` if there is one.

    A row a relay holds right now is being published: it is skipped, never waited for (a
    broker outage can keep a claim for many seconds), and what the caller does next (Celery's
    revoke broadcast) is what stops it. When the rows are gone for good (at commit), their
    results are marked REVOKED, as a worker would when it discards a revoked task.
    """
    with connections[alias].cursor() as cur:
        cur.execute(queries()[query], params)
        rows = [Cancelled(**dict(zip(_CANCELLED_FIELDS, r, strict=True))) for r in cur.fetchall()]
    if rows:
        log.info(
            "outbox.messages_cancelled",
            count=len(rows),
            held=sum(r.held for r in rows),
            task_ids=[r.task_id for r in rows][:20],
        )
        transaction.on_commit(functools.partial(mark_revoked, app, rows), using=alias)
    return rows


_CANCELLED_FIELDS = ("id", "task_id", "task_name", "held", "ignore_result")


def mark_revoked(app: Any, rows: Sequence[Cancelled]) -> None:
    """Store REVOKED in the result backend for cancelled tasks that keep results."""
    if app is None or _backend_disabled(app):
        return
    for row in rows:
        if row.ignore_result:
            continue
        try:
            app.backend.mark_as_revoked(row.task_id, reason="revoked before it was published")
        except Exception as exc:  # the rows are gone either way: report it and go on
            log.warning("outbox.revoke_result_failed", task_id=row.task_id, error=repr(exc))


def _backend_disabled(app: Any) -> bool:
    from celery.backends.base import DisabledBackend

    return isinstance(app.backend, DisabledBackend)


class OutboxControl(Control):
    """Celery's remote control, whose revoke first removes the task from the outbox.

    OutboxCelery uses it as `app.control`, so `AsyncResult.revoke()`, `GroupResult.revoke()`
    and `app.control.revoke()` cancel a task still waiting in the outbox (held until its ETA,
    or not published yet) before broadcasting Celery's usual revoke to the workers, which is
    what stops a task that was already published.
    """

    def revoke(
        self,
        task_id: str | Sequence[str],
        destination: Any = None,
        terminate: bool = False,
        signal: Any = TERM_SIGNAME,
        **kwargs: Any,
    ) -> Any:
        """Cancel the task's outbox rows (in the caller's transaction), then broadcast."""
        from outbox_notify._write import settings as write_settings

        ids = [task_id] if isinstance(task_id, str) else list(task_id)
        cancel_tasks(ids, alias=write_settings.current().alias, app=self.app)
        return super().revoke(
            task_id, destination=destination, terminate=terminate, signal=signal, **kwargs
        )
