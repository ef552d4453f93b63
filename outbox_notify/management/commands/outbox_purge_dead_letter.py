"""`manage.py outbox_purge_dead_letter`: delete old dead letters in small transactions."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from outbox_notify import deadletter
from outbox_notify.management.commands._common import (
    OutboxCommand,
    logs_to_stderr,
    reported,
    whole_number,
)
from outbox_notify.management.commands._progress import Progress

NEEDS = "SELECT, UPDATE and DELETE on outbox_notify_dead_letter_v1"


class Command(OutboxCommand):
    """Deletes dead letters older than N days, chunk by chunk; --dry-run only reports."""

    help = (
        "Delete dead letters older than --older-than-days (default: "
        "OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS), in chunks of --chunk-size rows, each in "
        "its own transaction. --dry-run prints what would go, per task name."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than-days", type=whole_number(0), default=None, metavar="N")
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument(
            "--chunk-size", type=whole_number(1), default=deadletter.CHUNK_SIZE, metavar="N"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with (
            reported(NEEDS),
            logs_to_stderr(),
            Progress(self.stderr, "deleting dead letters") as progress,
        ):
            result = deadletter.purge(
                options["older_than_days"],
                dry_run=options["dry_run"],
                chunk_size=options["chunk_size"],
                progress=progress.update,
            )
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
