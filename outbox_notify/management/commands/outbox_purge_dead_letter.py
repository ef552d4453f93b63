"""`manage.py outbox_purge_dead_letter`: delete old dead letters in small transactions."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox_notify import deadletter
from outbox_notify.exceptions import ConfigurationError


class Command(BaseCommand):
    """Deletes dead letters older than N days, chunk by chunk; --dry-run only reports."""

    help = (
        "Delete dead letters older than --older-than-days (default: "
        "OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS), in chunks of --chunk-size rows, each in "
        "its own transaction. --dry-run prints what would go, per task name."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than-days", type=int, default=None, metavar="N")
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument("--chunk-size", type=int, default=deadletter.CHUNK_SIZE)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = deadletter.purge(
                options["older_than_days"],
                dry_run=options["dry_run"],
                chunk_size=options["chunk_size"],
            )
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        if result.dry_run:
            self.stdout.write(
                f"would delete {result.deleted} dead letters that died before "
                f"{result.cutoff.isoformat()}"
            )
            for name, count in result.by_task.items():
                self.stdout.write(f"  {count:>10}  {name}")
            return
        self.stdout.write(
            f"deleted {result.deleted} dead letters that died before "
            f"{result.cutoff.isoformat()} ({result.chunks} chunks)"
        )
