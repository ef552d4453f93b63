"""Rebuilding the outbox's indexes once an old snapshot has let go of their dead rows.

While a snapshot stays open, every row the relay deletes stays in the table and in its indexes.
Once it ends, autovacuum frees the table's space and truncates its empty tail, but a B-tree only
reuses its empty pages: each index keeps the size it reached. REINDEX INDEX CONCURRENTLY gives
that space back without blocking writers or the relays.

Two callers share this: `manage.py outbox_reindex` (by hand or from cron, as the tables' owner)
and the relay's IndexKeeper (outbox_notify/index_keeper.py), which rebuilds on its own when
the indexes have grown far past the table they index. Both take any DB-API cursor in autocommit
(Django's or psycopg's) and report through `say`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from psycopg import sql as pgsql

from outbox_notify import stats

MIB = 1024 * 1024
# The relay rebuilds on its own when the indexes take more than BLOAT_RATIO times the table's
# own size and at least BLOAT_MIN_BYTES: in a steady state the indexes stay of the table's
# order of size, while after an old snapshot the table is truncated back and they are not.
BLOAT_RATIO = 4.0
BLOAT_MIN_BYTES = 16 * MIB

Say = Callable[[str], Any]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Index:
    """One index of the outbox table."""

    schema: str
    name: str
    bytes: int
    leftover: bool  # invalid, left by an interrupted rebuild
    owned: bool  # this role may rebuild it

    @property
    def identifier(self) -> pgsql.Identifier:
        return pgsql.Identifier(self.schema, self.name)


INDEX_FIELDS = tuple(field.name for field in dataclasses.fields(Index))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rebuilt:
    """What a rebuild did: sizes before and after, and what it had to give up on."""

    before: int
    after: int
    failed: tuple[str, ...]  # indexes whose rebuild waited too long for a running transaction
    undropped: tuple[str, ...]  # leftovers that could not be dropped (nothing was rebuilt)


def indexes(cur: Any) -> list[Index]:
    """The outbox table's indexes, with their size, validity and whether this role owns them."""
    cur.execute(stats.queries()["outbox_indexes"])
    return [Index(**dict(zip(INDEX_FIELDS, row, strict=True))) for row in cur.fetchall()]


def table_bytes(cur: Any) -> int:
    """The outbox table's own size (its heap, without indexes or TOAST)."""
    cur.execute(stats.queries()["outbox_table_bytes"])
    return int(cur.fetchone()[0])


def bloated(heap: int, found: list[Index], min_bytes: int = BLOAT_MIN_BYTES) -> bool:
    """Whether the indexes have grown far past what the table needs (see BLOAT_RATIO), or an
    interrupted rebuild left an invalid copy behind (it costs every write)."""
    size = sum(index.bytes for index in found if not index.leftover)
    leftover = any(index.leftover for index in found)
    return leftover or (size >= min_bytes and size > BLOAT_RATIO * heap)


def rebuild(
    cur: Any,
    found: list[Index],
    *,
    min_size: int,
    lock_wait: float,
    say: Say,
    first_failure_ends: bool = False,
    stopping: Callable[[], bool] = lambda: False,
) -> Rebuilt:
    """Drop the leftovers of an interrupted rebuild, then rebuild every index of at least
    `min_size` bytes, each waiting at most `lock_wait` seconds for running transactions.

    `first_failure_ends`: give up on the rest once one index waited too long (a long
    transaction would make each of them wait as long). `stopping`: asked before each index."""
    timeout_ms = str(max(1, int(lock_wait * 1000)))
    cur.execute(stats.queries()["set_reindex_lock_timeout"], {"timeout_ms": timeout_ms})
    try:
        leftovers = [index for index in found if index.leftover]
        if leftovers and not _drop(cur, leftovers, say):
            names = tuple(index.name for index in leftovers)
            return Rebuilt(before=0, after=0, failed=(), undropped=names)
        before = after = 0
        failed: list[str] = []
        for index in found:
            if index.leftover or index.bytes < min_size:
                continue
            if stopping() or (failed and first_failure_ends):
                break
            size = _rebuild_one(cur, index, failed, say)
            before, after = before + index.bytes, after + size
        return Rebuilt(before=before, after=after, failed=tuple(failed), undropped=())
    finally:
        cur.execute(stats.queries()["reset_lock_timeout"])


def _drop(cur: Any, leftovers: list[Index], say: Say) -> bool:
    """Drop invalid leftovers of an interrupted rebuild; False if one had to wait too long."""
    for index in leftovers:
        try:
            cur.execute(pgsql.SQL(stats.queries()["drop_index"]).format(index.identifier))
        except Exception as exc:  # only a lock timeout is expected
            if not is_lock_timeout(exc):
                raise
            return False
        say(f"{index.name}  dropped (left invalid by an interrupted rebuild)")
    return True


def _rebuild_one(cur: Any, index: Index, failed: list[str], say: Say) -> int:
    """Rebuild one index; its size after (its size before if the rebuild gave up)."""
    try:
        cur.execute(pgsql.SQL(stats.queries()["reindex_index"]).format(index.identifier))
    except Exception as exc:  # only a lock timeout is expected
        if not is_lock_timeout(exc):
            raise
        failed.append(index.name)
        # The copy it was building stays, invalid, if dropping it has to wait too: the next
        # rebuild drops it first.
        _drop(cur, _leftovers_of(cur, index), say)
        return index.bytes
    size = next(i.bytes for i in indexes(cur) if i.name == index.name)
    say(f"{index.name}  {size_text(index.bytes)} -> {size_text(size)}")
    return size


def is_lock_timeout(exc: BaseException) -> bool:
    cause = exc.__cause__ or exc
    return getattr(cause, "sqlstate", None) == "55P03"  # lock_not_available


def _leftovers_of(cur: Any, index: Index) -> list[Index]:
    """The invalid copies an interrupted rebuild of `index` left behind."""
    return [i for i in indexes(cur) if i.leftover and i.name.startswith(index.name[:50])]


def size_text(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
