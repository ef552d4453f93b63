"""`manage.py outbox_purge_inbox`: delete old OnceTask keys in small transactions."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from outbox_notify import inbox
from outbox_notify.management.commands._common import OutboxCommand, reported, whole_number

NEEDS = "SELECT, UPDATE and DELETE on outbox_notify_inbox_v1"


class Command(OutboxCommand):
    """Deletes inbox keys older than N days, chunk by chunk; --dry-run only reports."""

    help = (
        "Delete OnceTask inbox keys recorded more than --older-than-days ago (default: "
        "OUTBOX_NOTIFY_INBOX_RETENTION_DAYS), in chunks of --chunk-size rows, each in its own "
        "transaction. A duplicate delivered after its key is gone runs again: keep keys longer "
        "than any message can be delivered twice (docs/once.md). --dry-run prints what would "
        "go, per task name."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than-days", type=whole_number(0), default=None, metavar="N")
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument(
            "--chunk-size", type=whole_number(1), default=inbox.CHUNK_SIZE, metavar="N"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with reported(NEEDS):
            result = inbox.purge(
                options["older_than_days"],
                dry_run=options["dry_run"],
                chunk_size=options["chunk_size"],
            )
        cutoff = result.cutoff.isoformat()
        if result.dry_run:
            self.stdout.write(f"would delete {result.deleted} inbox keys recorded before {cutoff}")
            for name, count in result.by_task.items():
                self.stdout.write(f"  {count:>10}  {name}")
            return
        self.stdout.write(
            f"deleted {result.deleted} inbox keys recorded before {cutoff} ({result.chunks} chunks)"
        )
