"""An events Consumer for the tests, run in the test process and by `manage.py outbox_consume`.

Its exchange and queue come from OUTBOX_TEST_EVENTS_EXCHANGE / OUTBOX_TEST_EVENTS_QUEUE (each
test uses its own); the broker is tests.celery_app's (OUTBOX_TEST_BROKER_URL). Handlers write
an Effect row in their transaction, so counting rows counts the effects that committed. With
OUTBOX_TEST_RECORD_FILE set, every run of a handler is also recorded there (outside the
transaction, so failed and killed runs are recorded too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from outbox_notify.events import Consumer, Envelope

MAX_ATTEMPTS = 3
BACKOFF = 0.2  # seconds


@dataclasses.dataclass(frozen=True)
class OrderPlaced:
    """An event class whose type is its module and qualified name."""

    order_id: int
    marker: str
    fail_runs: int = 0  # runs that raise before one succeeds (-1: every run)
    sleep: float = 0.0  # seconds the first run sleeps after writing its effect


@dataclasses.dataclass(frozen=True)
class CardCreated:
    """An event class that declares its type."""

    event_type = "library.CardCreated"
    card: str


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def build(name: str = "tests-events") -> Consumer:
    """The test consumer, configured from the environment, with its handlers registered."""
    consumer = Consumer(
        _env("OUTBOX_TEST_EVENTS_NAME", name),
        exchange=_env("OUTBOX_TEST_EVENTS_EXCHANGE", "tests-events"),
        queue=os.environ.get("OUTBOX_TEST_EVENTS_QUEUE") or None,
        routing_keys=("tests.#", "library.#"),
        max_attempts=MAX_ATTEMPTS,
        backoff=BACKOFF,
        max_backoff=1.0,
        prefetch=int(_env("OUTBOX_TEST_EVENTS_PREFETCH", "16")),
    )
    consumer.handler(OrderPlaced, with_envelope=True)(on_order_placed)
    consumer.handler(CardCreated)(on_card_created)
    consumer.handler("tests.raw")(on_raw)
    consumer.handler("tests.self_terminate")(on_self_terminate)
    consumer.handler("tests.swallow")(on_swallow)
    return consumer


def record_run(event_id: str, what: str) -> None:
    """Append one run of a handler to OUTBOX_TEST_RECORD_FILE (when set)."""
    path = os.environ.get("OUTBOX_TEST_RECORD_FILE")
    if path:
        entry = {"id": event_id, "what": what, "pid": os.getpid(), "at": time.time()}
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def runs(path: Path, event_id: str) -> list[dict[str, Any]]:
    """The recorded runs of one event id."""
    if not path.exists():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if entry["id"] == event_id]


def write_effect(marker: str, event_id: str, attempt: int = 0) -> None:
    from tests.testapp.models import Effect

    Effect.objects.create(marker=marker, task_id=event_id, attempt=attempt)


def on_order_placed(event: OrderPlaced, envelope: Envelope) -> None:
    """Write an effect; the first run sleeps; the first `fail_runs` runs (recorded) raise."""
    path = os.environ.get("OUTBOX_TEST_RECORD_FILE")
    earlier = len(runs(Path(path), envelope.id)) if path else 0
    record_run(envelope.id, "order")
    write_effect(event.marker, envelope.id, earlier)
    if earlier == 0:
        time.sleep(event.sleep)
    if event.fail_runs < 0 or earlier < event.fail_runs:
        raise RuntimeError(f"{event.marker} run {earlier + 1} fails on purpose")


def on_card_created(event: CardCreated) -> None:
    """Write an effect named after the card."""
    write_effect(event.card, "card")


def on_self_terminate(envelope: Envelope) -> None:
    """Records the run, then ends its own database session (as a pooler's query_timeout would)."""
    from django.db import connection

    record_run(envelope.id, "self_terminate")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


def on_swallow(envelope: Envelope) -> None:
    """Writes an effect, then hits a unique violation and swallows it (a common pattern)."""
    from django.db import IntegrityError

    from tests.testapp.models import Effect

    write_effect(str(envelope.data["marker"]), envelope.id)
    try:
        with_key = Effect.objects.first()
        assert with_key is not None
        Effect.objects.create(id=with_key.id, marker="clash", task_id=envelope.id, attempt=0)
    except IntegrityError:
        pass  # the transaction is now marked for rollback: nothing of this run may commit


def on_raw(envelope: Envelope) -> None:
    """A type-string handler: gets the Envelope; writes an effect from its data."""
    write_effect(str(envelope.data["marker"]), envelope.id)


consumer = build()
