"""The chunked purge shared by dead letters (deadletter.py) and inbox keys (inbox.py).

Each chunk is deleted in its own short transaction, so a purge never holds one giant
transaction (long locks, bloat, replication lag) however many rows it removes; the cut-off is
taken on the database's clock, the one the rows' timestamps use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

import structlog
from django.db import connections, transaction

from outbox_notify.exceptions import ConfigurationError

log = structlog.get_logger("outbox_notify")

Progress = Callable[[int], None]  # told the running total after each chunk


def silent(done: int) -> None:
    """No progress to show."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PurgeResult:
    """What a purge deleted (or, in a dry run, would delete), per task name."""

    cutoff: datetime
    deleted: int
    chunks: int
    by_task: Mapping[str, int]
    dry_run: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """One table's purge: its named queries (with a `database_now`) and its log event."""

    queries: Callable[[], Mapping[str, str]]
    plan: str  # query: rows per task name older than %(cutoff)s
    chunk: str  # query: delete up to %(chunk)s rows older than %(cutoff)s
    event: str


def cutoff(target: Target, alias: str, days: int) -> datetime:
    """now() on the database's clock minus `days`."""
    with connections[alias].cursor() as cur:
        cur.execute(target.queries()["database_now"])
        now: datetime = cur.fetchone()[0]
    return now - timedelta(days=days)


def plan(target: Target, alias: str, before: datetime) -> dict[str, int]:
    """How many rows per task name are older than `before` (the dry-run report)."""
    with connections[alias].cursor() as cur:
        cur.execute(target.queries()[target.plan], {"cutoff": before})
        return {str(name): int(count) for name, count in cur.fetchall()}


def delete_chunk(target: Target, alias: str, before: datetime, chunk_size: int) -> int:
    """Delete one chunk in its own transaction; return how many rows went."""
    with transaction.atomic(using=alias), connections[alias].cursor() as cur:
        cur.execute(target.queries()[target.chunk], {"cutoff": before, "chunk": chunk_size})
        return int(cur.rowcount)


def purge(
    target: Target,
    days: int,
    *,
    alias: str,
    dry_run: bool,
    chunk_size: int,
    progress: Progress = silent,
) -> PurgeResult:
    """Delete the target's rows older than `days`, chunk by chunk (or count them: dry_run)."""
    if days < 0 or chunk_size < 1:
        raise ConfigurationError("older_than_days must be >= 0 and chunk_size >= 1")
    before = cutoff(target, alias, days)
    if dry_run:
        counts = plan(target, alias, before)
        return PurgeResult(
            cutoff=before, deleted=sum(counts.values()), chunks=0, by_task=counts, dry_run=True
        )
    deleted = chunks = 0
    while True:
        count = delete_chunk(target, alias, before, chunk_size)
        deleted, chunks = deleted + count, chunks + (count > 0)
        progress(deleted)
        if count < chunk_size:
            break
    log.info(target.event, deleted=deleted, chunks=chunks, older_than_days=days)
    return PurgeResult(cutoff=before, deleted=deleted, chunks=chunks, by_task={}, dry_run=False)
