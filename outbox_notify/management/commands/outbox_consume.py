"""manage.py outbox_consume: run an events Consumer until SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from outbox_notify import conf, inbox
from outbox_notify.events import consumer as consumers
from outbox_notify.events.delivery import OUTAGE_COOLDOWN, Runner
from outbox_notify.management.commands._common import OutboxCommand, one_line, reported, seconds

NEEDS = "SELECT and INSERT on outbox_notify_inbox_v1"


class Command(OutboxCommand):
    """Consume domain events once per event id, with retries and a dead-letter exchange."""

    help = (
        "Run the events Consumer at CONSUMER (a dotted path, e.g. shop.events.consumer): "
        "declare its exchange, queue and dead-letter exchange, then handle each event once "
        "(inbox). Exits 0 after SIGTERM/SIGINT once the event in hand is done."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("consumer", metavar="CONSUMER")
        parser.add_argument(
            "--outage-cooldown",
            type=seconds(),
            default=OUTAGE_COOLDOWN,
            metavar="SECONDS",
            help="pause between attempts to reach a broker or database that is down",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with reported(NEEDS):
            consumer = consumers.load(options["consumer"])
            runner = Runner(consumer, outage_cooldown=options["outage_cooldown"])
            _require_inbox()
            _require_broker(runner)
            with _stop_on_signals(runner):
                runner.run()


def _require_inbox() -> None:
    """Stop at start, in one line, when the inbox table is missing or not writable."""
    alias = conf.database_alias()
    connection = connections[alias]
    try:
        with connection.cursor() as cursor:
            cursor.execute(inbox.queries()["inbox_writable"])
            state = cursor.fetchone()[0]
    finally:
        connection.close()  # the consumer's handlers open it again when they need it
    if state == "missing":
        raise CommandError(
            f"the outbox tables are missing on database {alias!r} (no inbox table): run "
            "`python manage.py migrate outbox_notify`"
        )
    if state == "denied":
        raise CommandError(
            f"the database role of {alias!r} lacks {NEEDS}, which outbox_consume needs "
            "(see docs/security.md)"
        )


def _require_broker(runner: Runner) -> None:
    try:
        runner.check_reachable()
    except Exception as exc:
        raise CommandError(f"the broker cannot be reached: {one_line(exc)}") from exc


@contextlib.contextmanager
def _stop_on_signals(runner: Runner) -> Iterator[None]:
    """SIGTERM/SIGINT ask the runner to stop after the event in hand."""

    def handler(signum: int, frame: Any) -> None:
        runner.request_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
