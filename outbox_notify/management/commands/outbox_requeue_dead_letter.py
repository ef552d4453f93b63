"""`manage.py outbox_requeue_dead_letter`: move dead letters back to the outbox."""

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

NEEDS = (
    "SELECT, UPDATE and DELETE on outbox_notify_dead_letter_v1 and INSERT on "
    "outbox_notify_message_v1"
)


class Command(OutboxCommand):
    """Requeues dead letters chosen by id, task name or all, with retries reset."""

    help = (
        "Move dead letters back to the outbox (retries 0, created now, relative countdown "
        "and expires re-based to now), in chunks of --chunk-size rows per transaction. "
        "Choose exactly one of --id, --task-name, --all."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        chosen = parser.add_mutually_exclusive_group(required=True)
        chosen.add_argument("--id", type=whole_number(1), nargs="+", dest="ids", metavar="ID")
        chosen.add_argument("--task-name", metavar="NAME")
        chosen.add_argument("--all", action="store_true", dest="everything")
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument(
            "--chunk-size", type=whole_number(1), default=deadletter.CHUNK_SIZE, metavar="N"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        ids = tuple(options["ids"] or ())
        label = "checking dead letters" if options["dry_run"] else "requeueing dead letters"
        with (
            reported(NEEDS),
            logs_to_stderr(),
            Progress(self.stderr, label, total=len(set(ids)) or None) as progress,
        ):
            selector = deadletter.Selector(
                ids=ids, task_name=options["task_name"], everything=options["everything"]
            )
            result = deadletter.requeue(
                selector,
                dry_run=options["dry_run"],
                chunk_size=options["chunk_size"],
                progress=progress.update,
            )
        verb = "would requeue" if result.dry_run else "requeued"
        self.stdout.write(f"{verb} {result.moved} dead letters")
        for name, count in result.by_task.items():
            self.stdout.write(f"  {count:>10}  {name}")
        if result.already_expired:
            self.stderr.write(
                f"warning: {result.already_expired} of them carry an absolute expiry that has "
                "already passed; workers will discard them as expired"
            )
        if options["ids"] and result.moved < len(set(options["ids"])):
            missing = len(set(options["ids"])) - result.moved
            self.stderr.write(f"warning: {missing} of the given ids were not found or are locked")
