"""Dead-letter handling: purge old dead letters and move dead letters back to the outbox.

Both work in chunks, each in its own short transaction, so neither ever holds one giant
transaction (long locks, bloat, replication lag) however many rows they touch. Rows another
purge or requeue holds are skipped (SKIP LOCKED), never waited for. The commands, the Celery
task and the admin action are thin layers over the functions here.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog
from django.db import connections, transaction

from outbox_notify import _purging as purging
from outbox_notify import conf, serialization
from outbox_notify._purging import Progress, PurgeResult
from outbox_notify._purging import silent as _silent
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.stats import Cursor, queries

log = structlog.get_logger("outbox_notify")

CHUNK_SIZE = 5_000  # rows per transaction for purge and requeue


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Selector:
    """Which dead letters to requeue: exactly one of ids, task_name or everything."""

    ids: tuple[int, ...] = ()
    task_name: str | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        chosen = [bool(self.ids), self.task_name is not None, self.everything]
        if chosen.count(True) != 1:
            raise ConfigurationError("choose exactly one of: ids, a task name, or all")

    def query(self) -> tuple[str, dict[str, Any]]:
        """The named query selecting the next chunk, and its selector parameters."""
        if self.ids:
            return "dead_letters_by_ids", {"ids": list(self.ids)}
        if self.task_name is not None:
            return "dead_letters_by_task_name", {"task_name": self.task_name}
        return "dead_letters_all", {}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RequeueResult:
    """What a requeue moved (or, in a dry run, would move), per task name."""

    moved: int
    by_task: Mapping[str, int]
    already_expired: int
    dry_run: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rebased:
    """A dead letter's options made fit to send again at the requeue time."""

    options: str
    already_expired: bool


def _alias(using: str | None) -> str:
    """The database alias to work on: the one given, else OUTBOX_NOTIFY_DATABASE."""
    return using or conf.database_alias()


def _db_now(cur: Cursor) -> datetime:
    """The database's now() (its transaction start), the clock created_at and dead_at use."""
    cur.execute(queries()["database_now"])
    now: datetime = cur.fetchone()[0]
    return now


DEAD_LETTERS = purging.Target(
    queries=queries,
    plan="dead_letters_older_than_by_task",
    chunk="purge_dead_letters_chunk",
    event="outbox.dead_letters_purged",
)


def purge(
    older_than_days: int | None = None,
    *,
    dry_run: bool = False,
    chunk_size: int = CHUNK_SIZE,
    using: str | None = None,
    progress: Progress = _silent,
) -> PurgeResult:
    """Delete dead letters older than N days (default: the retention setting), chunk by chunk."""
    days = conf.dead_letter_retention_days() if older_than_days is None else older_than_days
    return purging.purge(
        DEAD_LETTERS,
        days,
        alias=_alias(using),
        dry_run=dry_run,
        chunk_size=chunk_size,
        progress=progress,
    )


def _moment(value: Any) -> datetime | None:
    """A stored ISO time as the worker reads it (naive ones are UTC), None when unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return serialization.header_time(value)
    except ValueError:
        return None


def _shift(headers: dict[str, Any], relative: Mapping[str, Any], now: datetime) -> bool:
    """Re-base eta/expires from the stored relative seconds; True when a header changed."""
    changed = False
    for relative_key, header in (("countdown", "eta"), ("expires", "expires")):
        seconds = relative.get(relative_key)
        if isinstance(seconds, int | float) and not isinstance(seconds, bool):
            headers[header] = (now + timedelta(seconds=seconds)).isoformat()
            changed = True
    return changed


def rebase_options(text: str, now: datetime) -> Rebased:
    """Re-base relative countdown/expires to `now`; flag an absolute expires already past.

    The stored text is returned untouched unless a time changes (it is kombu JSON, kept
    byte for byte), and also when it cannot be decoded: the relay then dead-letters it again
    with a precise reason, which is more useful than failing the whole requeue here.
    """
    try:
        options = json.loads(text)
        # The compact layout (version 4) leaves out `headers` when all are at their defaults.
        headers, relative = options.get("headers", {}), options.get("relative") or {}
        if not isinstance(headers, dict) or not isinstance(relative, Mapping):
            return Rebased(options=text, already_expired=False)
    except (ValueError, TypeError, AttributeError):
        return Rebased(options=text, already_expired=False)
    changed = _shift(headers, relative, now)
    if changed:
        options["headers"] = headers
    expires = _moment(headers.get("expires"))
    return Rebased(
        options=json.dumps(options) if changed else text,
        already_expired=expires is not None and expires <= now,
    )


def _move(cur: Cursor, ids: Sequence[int], options: Sequence[str]) -> int:
    """Move these locked dead letters to the outbox with their new options; return the count."""
    cur.execute(
        queries()["requeue_dead_letters_chunk"], {"ids": list(ids), "options": list(options)}
    )
    return int(cur.rowcount)


def _requeue_chunk(
    alias: str, selector: Selector, after: int, chunk_size: int, dry_run: bool
) -> tuple[list[tuple[int, str]], int, int]:
    """One transaction: lock the next chunk, re-base it, move it unless dry-running.

    Returns the (id, task_name) of the chunk's rows, how many were moved and how many were
    already expired.
    """
    name, params = selector.query()
    with transaction.atomic(using=alias), connections[alias].cursor() as cur:
        now = _db_now(cur)
        cur.execute(queries()[name], {**params, "after": after, "chunk": chunk_size})
        rows = cur.fetchall()
        rebased = [rebase_options(text, now) for _, _, text in rows]
        moved = (
            len(rows) if dry_run else _move(cur, [r[0] for r in rows], [r.options for r in rebased])
        )
        return [(r[0], r[1]) for r in rows], moved, sum(r.already_expired for r in rebased)


def requeue(
    selector: Selector,
    *,
    dry_run: bool = False,
    chunk_size: int = CHUNK_SIZE,
    using: str | None = None,
    progress: Progress = _silent,
) -> RequeueResult:
    """Move the selected dead letters back to the outbox: retries 0, created now, times re-based."""
    if chunk_size < 1:
        raise ConfigurationError("chunk_size must be >= 1")
    alias, after = _alias(using), 0
    moved = expired = 0
    by_task: Counter[str] = Counter()
    while True:
        rows, count, chunk_expired = _requeue_chunk(alias, selector, after, chunk_size, dry_run)
        if not rows:
            break
        by_task.update(name for _, name in rows)
        moved, expired, after = moved + count, expired + chunk_expired, rows[-1][0]
        progress(moved)
    if not dry_run:
        log.info("outbox.dead_letters_requeued", moved=moved, already_expired=expired)
    if expired:
        log.warning("outbox.requeued_already_expired", count=expired, dry_run=dry_run)
    return RequeueResult(
        moved=moved, by_task=dict(by_task.most_common()), already_expired=expired, dry_run=dry_run
    )
