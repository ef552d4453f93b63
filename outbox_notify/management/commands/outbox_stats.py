"""`manage.py outbox_stats`: print the outbox's health; exit 2 when it lags (for probes)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from outbox_notify import conf, inbox, metrics_prometheus, stats
from outbox_notify.management.commands._common import OutboxCommand, reported, seconds, whole_number

LAG_EXIT_CODE = 2  # distinct from 1 (any other error), so a probe can tell lag from a crash
NEEDS = (
    "SELECT on outbox_notify_message_v1, outbox_notify_dead_letter_v1, outbox_notify_frontier_v1 "
    "and outbox_notify_inbox_v1 (and pg_read_all_stats to see other roles' relay sessions)"
)
NOT_COMPUTED = "top_failing            not computed (--top 0)"


class Command(OutboxCommand):
    """Prints queue depth, lag, dead letters, relays and failing tasks as text or JSON."""

    help = (
        "Print the outbox's health (queue depth, oldest pending age, dead letters, relays, "
        "top failing tasks). Exit code 2 with --fail-if-lag-above when the oldest pending "
        "message is older than that many seconds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--format",
            choices=("text", "json", "prometheus"),
            default="text",
            help="prometheus: the gauges in Prometheus's text format, for a textfile collector",
        )
        parser.add_argument(
            "--top",
            type=whole_number(0),
            default=stats.DEFAULT_TOP,
            metavar="N",
            help="task names in top_failing; 0 skips that query (default %(default)s)",
        )
        parser.add_argument(
            "--fail-if-lag-above",
            type=seconds(allow_zero=True),
            default=None,
            metavar="SECONDS",
            help="exit with code 2 when the oldest pending message is older than this",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        top = options["top"]
        connection = connections[conf.database_alias()]
        with reported(NEEDS):
            snapshot = stats.collect(connection, top=top)
            keys = inbox.collect_stats(connection)
        if options["format"] == "prometheus":
            self.stdout.write(metrics_prometheus.stats_exposition(snapshot), ending="")
        elif options["format"] == "json":
            data = {**as_json(snapshot, top), **keys.as_dict()}
            data["exact"]["inbox_records"] = keys.records_exact
            self.stdout.write(json.dumps(data, sort_keys=True))
        else:
            self.stdout.write(with_inbox(as_text(snapshot, top), keys))
        limit = options["fail_if_lag_above"]
        if limit is not None and snapshot.oldest_pending_seconds > limit:
            raise CommandError(
                f"oldest pending message is {snapshot.oldest_pending_seconds:.1f}s old, "
                f"above --fail-if-lag-above={limit:g}",
                returncode=LAG_EXIT_CODE,
            )


def as_json(snapshot: stats.OutboxStats, top: int) -> dict[str, Any]:
    """The JSON document; with --top 0, top_failing and events are null (not computed)."""
    data = snapshot.as_dict()
    if top == 0:
        for key in ("top_failing", "events"):
            data[key] = None
            data["exact"][key] = None
    return data


def as_text(snapshot: stats.OutboxStats, top: int) -> str:
    """The text form; with --top 0 it says top_failing was not computed, not "(none)"."""
    text = stats.format_text(snapshot)
    if top == 0:
        text = text[: text.index("\ntop_failing")] + "\n" + NOT_COMPUTED
    return text


def with_inbox(text: str, keys: inbox.InboxStats) -> str:
    """The inbox lines among the other figures, before the top_failing list that ends the text."""
    head, marker, tail = text.partition("\ntop_failing")
    return f"{head}\n{inbox.format_text(keys)}{marker}{tail}"
