"""`manage.py outbox_reindex`: give back the space an old snapshot left in the outbox's indexes.

While a snapshot stays open, every row the relay deletes stays in the table and in its indexes.
Once it ends, autovacuum frees the table's space and truncates its empty tail, but a B-tree
only reuses its empty pages: each index keeps the size it reached. This command rebuilds the
outbox's indexes with REINDEX INDEX CONCURRENTLY, which does not block writers or the relays,
and refuses while a snapshot still holds dead rows back (the new index would keep them).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from outbox_notify import conf, reindex, stats
from outbox_notify.management.commands._common import OutboxCommand, reported, seconds, whole_number

NEEDS = "ownership of outbox_notify_message_v1 (run it as the role that ran migrate)"
DEFAULT_MIN_SIZE = 1  # MiB: smaller indexes are left alone, there is nothing to give back
DEFAULT_REFUSE_ABOVE = 100_000  # held dead rows, the relay's outbox.vacuum_held_back threshold
DEFAULT_LOCK_WAIT = 60.0  # seconds a rebuild waits for the transactions running when it began


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
            help="do nothing while a snapshot holds more of the outbox's dead rows than "
            "this (rows the last vacuum had to leave; default %(default)s)",
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
            found = reindex.indexes(cur)
            if not all(index.owned for index in found):
                alias = conf.database_alias()
                raise CommandError(
                    f"the role in DATABASES[{alias!r}] lacks {NEEDS}; REINDEX needs it "
                    "(docs/security.md)"
                )
            if options["dry_run"]:
                self._plan(found, options["min_size"])
                return
            cur.execute(stats.queries()["try_reindex_lock"])
            if not cur.fetchone()[0]:
                raise CommandError(
                    "another rebuild of the outbox's indexes is running (a relay's, or another "
                    "outbox_reindex): run it again once that one has ended"
                )
            try:
                done = reindex.rebuild(
                    cur,
                    found,
                    min_size=options["min_size"] * reindex.MIB,
                    lock_wait=options["lock_wait"],
                    say=self.stdout.write,
                )
            finally:
                cur.execute(stats.queries()["reindex_unlock"])
        if done.undropped:
            raise CommandError(
                f"could not drop {', '.join(done.undropped)} (left invalid by an "
                "interrupted rebuild) within --lock-wait: a long transaction is running; "
                "run outbox_reindex again once it has ended"
            )
        self.stdout.write(
            f"outbox indexes: {reindex.size_text(done.before)} -> {reindex.size_text(done.after)}"
        )
        if done.failed:
            raise CommandError(
                f"could not rebuild {', '.join(done.failed)} within --lock-wait: a long "
                "transaction is running; run outbox_reindex again once it has ended"
            )

    def _refuse_while_held(self, cur: Any, refuse_above: int) -> None:
        horizon = stats.vacuum_horizon(cur)
        holder = horizon.holder
        if holder is not None and horizon.dead_rows_held > refuse_above:
            raise CommandError(
                f"{horizon.dead_rows_held} dead rows are still held back by "
                f"{stats.holder_text(holder)}: a rebuilt index would keep them; end that "
                "transaction first (docs/operations.md, 'Dead rows and old snapshots')"
            )

    def _plan(self, found: list[reindex.Index], min_size: int) -> None:
        for index in found:
            action = "drop (left by an interrupted rebuild)" if index.leftover else "rebuild"
            if not index.leftover and index.bytes < min_size * reindex.MIB:
                action = "leave (below --min-size)"
            self.stdout.write(f"{index.name}  {reindex.size_text(index.bytes)}  {action}")
