"""`manage.py outbox_list`: list pending or held outbox rows, or dead letters."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from outbox_notify import listing
from outbox_notify.management.commands._common import (
    OutboxCommand,
    logs_to_stderr,
    reported,
    seconds,
    whole_number,
)
from outbox_notify.management.commands._progress import Progress

NEEDS = "SELECT on outbox_notify_message_v1 and outbox_notify_dead_letter_v1"
PROGRESS_FROM = 5_000  # rows: a --limit from which reading shows progress on a terminal


class Command(OutboxCommand):
    """Lists outbox rows in one state, filtered, as a table or JSON lines."""

    help = (
        "List outbox rows that are pending (ready or waiting for a retry) or held until their "
        "ETA, or dead letters, oldest first (held: soonest due first); arguments are shown "
        "redacted as in the admin."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--state", choices=[s.value for s in listing.State], default="pending")
        parser.add_argument("--task-name", metavar="NAME", help="only this task name (exact)")
        parser.add_argument(
            "--older-than",
            type=seconds(allow_zero=True),
            default=None,
            metavar="SECONDS",
            help="only rows created (dead letters: that died) more than this long ago",
        )
        parser.add_argument(
            "--error-contains",
            metavar="TEXT",
            help="only rows whose last error (dead letters: failure reason) contains TEXT, "
            "ignoring case",
        )
        parser.add_argument("--limit", type=whole_number(1), default=100, metavar="N")
        parser.add_argument("--format", choices=("table", "json"), default="table")

    def handle(self, *args: Any, **options: Any) -> None:
        filters = listing.Filters(
            state=listing.State(options["state"]),
            task_name=options["task_name"],
            older_than=options["older_than"],
            error_contains=options["error_contains"],
            limit=options["limit"],
        )
        total = filters.limit if filters.limit >= PROGRESS_FROM else 0
        found: list[listing.Listed] = []
        with (
            reported(NEEDS),
            logs_to_stderr(),
            Progress(self.stderr, "reading rows", total=total) as progress,
        ):
            for row in listing.rows(filters):
                found.append(row)
                if total:
                    progress.update(len(found))
        if options["format"] == "json":
            self.stdout.write(json.dumps([row.as_dict() for row in found], ensure_ascii=False))
            return
        if not found:
            self.stderr.write(f"no {filters.state.value} rows match")
            return
        for line in listing.table(filters.state, found):
            self.stdout.write(line)
