"""`manage.py outbox_stats`: print the outbox's health; exit 2 when it lags (for probes)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from outbox_notify import conf, stats

LAG_EXIT_CODE = 2  # distinct from 1 (any other error), so a probe can tell lag from a crash


class Command(BaseCommand):
    """Prints queue depth, lag, dead letters, relays and failing tasks as text or JSON."""

    help = (
        "Print the outbox's health (queue depth, oldest pending age, dead letters, relays, "
        "top failing tasks). Exit code 2 with --fail-if-lag-above when the oldest pending "
        "message is older than that many seconds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=("text", "json"), default="text")
        parser.add_argument(
            "--top", type=int, default=stats.DEFAULT_TOP, help="task names in top_failing"
        )
        parser.add_argument(
            "--fail-if-lag-above",
            type=float,
            default=None,
            metavar="SECONDS",
            help="exit with code 2 when the oldest pending message is older than this",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        connection = connections[conf.database_alias()]
        snapshot = stats.collect(connection, top=max(options["top"], 0))
        if options["format"] == "json":
            self.stdout.write(json.dumps(snapshot.as_dict(), sort_keys=True))
        else:
            self.stdout.write(stats.format_text(snapshot))
        limit = options["fail_if_lag_above"]
        if limit is not None and snapshot.oldest_pending_seconds > limit:
            raise CommandError(
                f"oldest pending message is {snapshot.oldest_pending_seconds:.1f}s old, "
                f"above --fail-if-lag-above={limit:g}",
                returncode=LAG_EXIT_CODE,
            )
