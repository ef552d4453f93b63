"""Writes the row fixture of the current schema_version: rows as this release's writer stores them.

Run once when a schema version is added (docs/install.md, "Adding a schema version"), against
a database where the outbox tables exist, and commit the output as `vN.json`. The fixture of a
released version is frozen: tests/integration/test_schema_versions.py publishes every fixture
with the current relay, so each older version's rows stay publishable.

    DJANGO_SETTINGS_MODULE=tests.settings OUTBOX_TEST_DB_NAME=dbname \\
        OUTBOX_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python -m tests.schema_rows.capture 2 > tests/schema_rows/v2.json

Each sample pairs a call with what the worker must receive for it; the queue is the
placeholder QUEUE, which the test replaces with a queue of its own. Nothing is committed: the
rows are read back inside a transaction that is rolled back.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import sys
import uuid
from collections.abc import Callable
from typing import Any

QUEUE = "__QUEUE__"
WHEN = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
NEVER = dt.datetime(2099, 12, 31, 0, 0, tzinfo=dt.UTC)


class _Rollback(Exception):
    """Ends the capture transaction without committing anything."""


def _samples() -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    import structlog
    from celery import chain, chord, group
    from kombu import Queue

    from tests.celery_app import add, fail, record

    def context_call() -> Any:
        import sentry_sdk

        # An active client (that never sends) makes the writer store the trace headers.
        sentry_sdk.init(
            dsn="https://public@sentry.invalid/1",
            default_integrations=False,
            auto_enabling_integrations=False,
        )
        try:
            with structlog.contextvars.bound_contextvars(request_id="req-1"):
                return add.apply_async((4, 4), queue=QUEUE)
        finally:
            sentry_sdk.init()

    tagged_args = [WHEN, uuid.UUID(int=7), decimal.Decimal("1.50")]
    event, event_headers = _event()
    return [
        ("plain", lambda: add.apply_async((2, 3), queue=QUEUE), {"args": [2, 3], "kwargs": {}}),
        (
            "scheduled",
            lambda: add.apply_async(
                (1,),
                {"y": 2},
                queue=QUEUE,
                eta=WHEN,
                expires=NEVER,
                headers={"x-tenant": "acme"},
                time_limit=30,
                soft_time_limit=20,
                shadow="tests.add-shadow",
                ignore_result=True,
            ),
            {
                "args": [1],
                "kwargs": {"y": 2},
                "headers": {
                    "eta": WHEN.isoformat(),
                    "expires": NEVER.isoformat(),
                    "x-tenant": "acme",
                    "timelimit": [30, 20],
                    "shadow": "tests.add-shadow",
                    "ignore_result": True,
                },
            },
        ),
        (
            "linked",
            lambda: add.apply_async((1, 1), queue=QUEUE, link=record.s(), link_error=fail.s()),
            {
                "args": [1, 1],
                "kwargs": {},
                "embed_tasks": {"callbacks": ["tests.record"], "errbacks": ["tests.fail"]},
            },
        ),
        (
            "chain",
            # The result is the last task's; the row written is the first one's.
            lambda: chain(add.s(1, 1), record.s()).apply_async(queue=QUEUE).parent,
            {"args": [1, 1], "kwargs": {}, "embed_tasks": {"chain": ["tests.record"]}},
        ),
        (
            "tagged",
            lambda: record.apply_async(tagged_args, {"when": WHEN}, queue=QUEUE),
            {"args": tagged_args, "kwargs": {"when": WHEN}},
        ),
        ("context", context_call, {"args": [4, 4], "kwargs": {}}),
        (
            # Version 2: a chord's header row, carrying the chord's result-backend calls.
            "chord-header",
            lambda: chord([add.s(1, 1).set(queue=QUEUE)])(add.s(5).set(queue=QUEUE)).parent.results[
                0
            ],
            {"args": [1, 1], "kwargs": {}},
        ),
        (
            # Version 4 stores a queue declared only by the writer (not the one its
            # configuration gives for that name) whole, as version 1 stored every queue.
            "writer-queue",
            lambda: add.apply_async(
                (3, 4), queue=Queue(QUEUE, queue_arguments={"x-max-priority": 10})
            ),
            {"args": [3, 4], "kwargs": {}},
        ),
        (
            # Version 4: a group member, its group id and index among the stored headers.
            "group-member",
            lambda: (
                group(add.s(5, 6).set(queue=QUEUE), add.s(7, 8).set(queue=QUEUE))
                .apply_async()
                .results[1]
            ),
            {"args": [7, 8], "kwargs": {}, "headers": {"group_index": 1}},
        ),
        (
            # Version 3: a domain event (outbox_notify.events.publish), routed to the
            # placeholder as a topic exchange with the event's type as routing key.
            "event",
            lambda: _publish(event, event_headers),
            {"event": event.attributes(), "headers": event_headers, "routing_key": event.type},
        ),
    ]


def _event() -> tuple[Any, dict[str, Any]]:
    """The event sample, and the headers it must arrive with (binding headers, then the user's)."""
    from django.conf import settings

    from outbox_notify.events.envelope import Envelope, binding_headers

    event = Envelope(
        id="7d8f4c1e-3b1a-4c55-9e0f-2a6b9d1c0e42",
        source=settings.OUTBOX_NOTIFY_EVENT_SOURCE,
        type="tests.order.placed",
        time=WHEN,
        subject="order-7",
        data={"order": 7, "when": WHEN, "price": decimal.Decimal("1.50"), "lines": [1, 2]},
    )
    return event, {**binding_headers(event), "x-tenant": "acme"}


def _publish(event: Any, headers: dict[str, Any]) -> Any:
    from outbox_notify import events

    mapping = {key: getattr(event, key) for key in ("type", "id", "time", "subject", "data")}
    return events.publish(mapping, exchange=QUEUE, headers={"x-tenant": headers["x-tenant"]})


def _read_row(task_id: str) -> dict[str, Any]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT task_id, task_name, args::text, kwargs::text, options::text, context::text,"
            " schema_version FROM outbox_notify_message_v1 WHERE task_id = %s",
            [task_id],
        )
        values = cursor.fetchone()
    names = ["task_id", "task_name", "args", "kwargs", "options", "context", "schema_version"]
    return dict(zip(names, values, strict=True))


def capture(version: int) -> dict[str, Any]:
    """The fixture of `version`: each sample stored in that layout, with its expectation."""
    from django.db import transaction
    from kombu.utils import json as kombu_json

    rows: list[dict[str, Any]] = []
    try:
        with transaction.atomic():
            for name, call, wanted in _samples():
                row = _read_row(call().id)
                if row["schema_version"] != version:
                    continue
                # The trace headers the writer captured must reach the worker as headers.
                sentry = json.loads(row["context"]).get("sentry", {})
                expect = {**wanted, "headers": {**wanted.get("headers", {}), **sentry}}
                rows.append({"name": name, "columns": row, "expect": expect})
            raise _Rollback
    except _Rollback:
        pass
    # The expectations go through kombu's encoder so datetimes and UUIDs keep their tags.
    return {"schema_version": version, "rows": json.loads(kombu_json.dumps(rows))}


def main() -> None:
    import django

    django.setup()
    from outbox_notify.serialization import SCHEMA_VERSION

    version = int(sys.argv[1]) if len(sys.argv) > 1 else SCHEMA_VERSION
    json.dump(capture(version), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
