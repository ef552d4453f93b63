"""`manage.py outbox_consume_dead`: list or replay an events Consumer's dead letters."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from outbox_notify.events import consumer as consumers
from outbox_notify.events import dead_letters
from outbox_notify.management.commands._common import (
    OutboxCommand,
    logs_to_stderr,
    one_line,
    whole_number,
)


class Command(OutboxCommand):
    """Lists (non-destructively) or replays the dead letters of one events Consumer."""

    help = (
        "List the dead letters of an outbox_notify.events.Consumer (they stay in their queue), "
        "or replay them to the consumer's queue (all, or those with the given event ids)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("consumer", metavar="CONSUMER", help="dotted path of the Consumer")
        action = parser.add_mutually_exclusive_group(required=True)
        action.add_argument("--list", action="store_true", dest="listing")
        action.add_argument("--replay", action="store_true")
        parser.add_argument(
            "--id", nargs="+", dest="ids", metavar="EVENT_ID", help="with --replay: only these"
        )
        parser.add_argument("--limit", type=whole_number(1), default=100, metavar="N")
        parser.add_argument("--format", choices=("table", "json"), default="table")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["ids"] and not options["replay"]:
            raise CommandError("--id goes with --replay")
        try:
            consumer = consumers.load(options["consumer"])
        except Exception as exc:
            raise CommandError(one_line(exc)) from exc
        try:
            with logs_to_stderr():
                if options["listing"]:
                    self._list(consumer, options)
                else:
                    self._replay(consumer, options["ids"])
        except CommandError:
            raise
        except Exception as exc:  # kombu's connection errors vary with the transport
            raise CommandError(f"the broker cannot be reached: {one_line(exc)}") from exc

    def _list(self, consumer: consumers.Consumer, options: dict[str, Any]) -> None:
        found = dead_letters.list_dead(consumer, limit=options["limit"])
        if options["format"] == "json":
            self.stdout.write(json.dumps([d.as_dict() for d in found], ensure_ascii=False))
            return
        if not found:
            self.stderr.write(f"no dead letters in {consumer.dead_letter_exchange!r}")
            return
        for dead in found:
            self.stdout.write(
                f"{dead.event_id or '-'}  {dead.event_type or '-'}  {dead.kind}  "
                f"attempts={dead.attempts}  {dead.dead_at}  {dead.reason}  {dead.data}"
            )

    def _replay(self, consumer: consumers.Consumer, ids: list[str] | None) -> None:
        result = dead_letters.replay(consumer, ids=ids)
        self.stdout.write(
            f"replayed {len(result.replayed)} dead letters to queue {consumer.queue!r}"
        )
        if result.missing:
            self.stderr.write(
                f"warning: {len(result.missing)} of the given ids were not found: "
                + ", ".join(result.missing)
            )
