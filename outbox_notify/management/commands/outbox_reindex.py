"""`manage.py outbox_reindex`: give back the space an old snapshot left in the outbox's indexes.

While a snapshot stays open, every row the relay deletes stays in the table and in its indexes.
Once it ends, autovacuum frees the table's space and truncates its empty tail, but a B-tree
only reuses its empty pages: each index keeps the size it reached. This command rebuilds the
outbox's indexes with REINDEX INDEX CONCURRENTLY, which does not block writers or the relays,
and refuses while a snapshot still holds dead rows back (the new index would keep them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections
from psycopg import sql as pgsql

from outbox_notify import conf, stats
from outbox_notify.management.commands._common import OutboxCommand, reported, seconds, whole_number

NEEDS = "ownership of outbox_notify_message_v1 (run it as the role that ran migrate)"
DEFAULT_MIN_SIZE = 1  # MiB: smaller indexes are left alone, there is nothing to give back
DEFAULT_REFUSE_ABOVE = 100_000  # dead rows, the relay's outbox.vacuum_held_back threshold
DEFAULT_LOCK_WAIT = 60.0  # seconds a rebuild waits for the transactions running when it began
MIB = 1024 * 1024


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


class Command(OutboxCommand):
    """Rebuilds the outbox's indexes without blocking writers, once no snapshot holds them."""

    help = (
        "Rebuild the outbox table's indexes with REINDEX INDEX CONCURRENTLY (writers and "
        "relays go on), giving back the space dead rows took while an old snapshot was open. "
        "Refuses while a snapshot still holds many dead rows. Safe to run from cron."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--min-size",
            type=whole_number(0),
            default=DEFAULT_MIN_SIZE,
            metavar="MIB",
            help="rebuild only indexes at least this large (default %(default)s MiB)",
        )
        parser.add_argument(
            "--refuse-above",
            type=whole_number(0),
            default=DEFAULT_REFUSE_ABOVE,
            metavar="ROWS",
            help="do nothing while the outbox has more dead rows than this and a snapshot "
            "holds them (default %(default)s)",
        )
        parser.add_argument(
            "--lock-wait",
            type=seconds(allow_zero=False),
            default=DEFAULT_LOCK_WAIT,
            metavar="SECONDS",
            help="give up on an index whose rebuild waits longer than this for running "
            "transactions (default %(default)s)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="print what would be rebuilt, change nothing"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        connection = connections[conf.database_alias()]
        if connection.in_atomic_block:
            raise CommandError("outbox_reindex cannot run inside a transaction (atomic block)")
        with reported(NEEDS), connection.cursor() as cur:
            self._refuse_while_held(cur, options["refuse_above"])
            cur.execute(stats.queries()["outbox_indexes"])
            indexes = [Index(**dict(zip(INDEX_FIELDS, row, strict=True))) for row in cur.fetchall()]
            if not all(index.owned for index in indexes):
                alias = conf.database_alias()
                raise CommandError(
                    f"the role in DATABASES[{alias!r}] lacks {NEEDS}; REINDEX needs it "
                    "(docs/security.md)"
                )
            if options["dry_run"]:
                self._plan(indexes, options["min_size"])
                return
            timeout_ms = str(max(1, int(options["lock_wait"] * 1000)))
            cur.execute(stats.queries()["set_reindex_lock_timeout"], {"timeout_ms": timeout_ms})
            try:
                self._rebuild(cur, indexes, options["min_size"])
            finally:
                cur.execute(stats.queries()["reset_lock_timeout"])

    def _refuse_while_held(self, cur: Any, refuse_above: int) -> None:
        dead_rows, holder = stats.vacuum_horizon(cur)
        if holder is not None and dead_rows > refuse_above:
            raise CommandError(
                f"{dead_rows} dead rows are still held back by {stats.holder_text(holder)}: "
                "a rebuilt index would keep them; end that transaction first "
                "(docs/operations.md, 'Dead rows and old snapshots')"
            )

    def _plan(self, indexes: list[Index], min_size: int) -> None:
        for index in indexes:
            action = "drop (left by an interrupted rebuild)" if index.leftover else "rebuild"
            if not index.leftover and index.bytes < min_size * MIB:
                action = "leave (below --min-size)"
            self.stdout.write(f"{index.name}  {_size(index.bytes)}  {action}")

    def _rebuild(self, cur: Any, indexes: list[Index], min_size: int) -> None:
        leftovers = [index for index in indexes if index.leftover]
        if leftovers and not self._drop(cur, leftovers):
            raise CommandError(
                f"could not drop {', '.join(i.name for i in leftovers)} (left invalid by an "
                "interrupted rebuild) within --lock-wait: a long transaction is running; "
                "run outbox_reindex again once it has ended"
            )
        before = after = 0
        failed: list[str] = []
        for index in indexes:
            if index.leftover or index.bytes < min_size * MIB:
                continue
            size = self._rebuild_one(cur, index, failed)
            before, after = before + index.bytes, after + size
        self.stdout.write(f"outbox indexes: {_size(before)} -> {_size(after)}")
        if failed:
            raise CommandError(
                f"could not rebuild {', '.join(failed)} within --lock-wait: a long transaction "
                "is running; run outbox_reindex again once it has ended"
            )

    def _drop(self, cur: Any, leftovers: list[Index]) -> bool:
        """Drop invalid leftovers of an interrupted rebuild; False if one had to wait too long."""
        for index in leftovers:
            try:
                cur.execute(pgsql.SQL(stats.queries()["drop_index"]).format(index.identifier))
            except Exception as exc:  # only a lock timeout is expected
                if not _is_lock_timeout(exc):
                    raise
                return False
            self.stdout.write(f"{index.name}  dropped (left invalid by an interrupted rebuild)")
        return True

    def _rebuild_one(self, cur: Any, index: Index, failed: list[str]) -> int:
        """Rebuild one index; its size after (its size before if the rebuild gave up)."""
        try:
            cur.execute(pgsql.SQL(stats.queries()["reindex_index"]).format(index.identifier))
        except Exception as exc:  # only a lock timeout is expected
            if not _is_lock_timeout(exc):
                raise
            failed.append(index.name)
            # The copy it was building stays, invalid, if dropping it has to wait too: the
            # next run drops it first.
            self._drop(cur, _leftovers_of(cur, index))
            return index.bytes
        cur.execute(stats.queries()["outbox_indexes"])
        size = next(row[2] for row in cur.fetchall() if row[1] == index.name)
        self.stdout.write(f"{index.name}  {_size(index.bytes)} -> {_size(size)}")
        return int(size)


INDEX_FIELDS = tuple(field.name for field in dataclasses.fields(Index))


def _is_lock_timeout(exc: BaseException) -> bool:
    cause = exc.__cause__ or exc
    return getattr(cause, "sqlstate", None) == "55P03"  # lock_not_available


def _leftovers_of(cur: Any, index: Index) -> list[Index]:
    """The invalid copies an interrupted rebuild of `index` left behind."""
    cur.execute(stats.queries()["outbox_indexes"])
    found = [Index(**dict(zip(INDEX_FIELDS, row, strict=True))) for row in cur.fetchall()]
    return [i for i in found if i.leftover and i.name.startswith(index.name[:50])]


def _size(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
