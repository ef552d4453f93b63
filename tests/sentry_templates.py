"""Run by test_template_sentry.py in its own process: Sentry's Celery integration patches
Celery for the life of a process, so it must not run inside the test session.

Prints one JSON object: the rows of the same calls through the template path and through
Celery's full path, and the Sentry spans each recorded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import sentry_sdk
from sentry_sdk.transport import Transport


class Keep(Transport):
    """Keeps Sentry envelopes in memory."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.envelopes: list[Any] = []

    def capture_envelope(self, envelope: Any) -> None:
        self.envelopes.append(envelope)


def spans(transport: Keep) -> list[list[str]]:
    """The span ops of each transaction Sentry sent, in order."""
    found = []
    for envelope in transport.envelopes:
        for item in envelope.items:
            event = item.get_transaction_event()
            if event:
                found.append([span["op"] for span in event.get("spans", [])])
    return found


def main() -> None:
    transport = Keep()
    # Default integrations: Sentry's Celery integration patches Task.apply_async and
    # Celery.send_task, as it does in an application that initialises Sentry.
    sentry_sdk.init(
        dsn="https://public@sentry.invalid/1", transport=transport, traces_sample_rate=1.0
    )
    import django

    django.setup()
    from outbox_notify import app as outbox_app
    from outbox_notify._write import instrumentation, message_templates
    from outbox_notify.app import RecordingProducer
    from tests.celery_app import add, app

    rows: list[Any] = []
    outbox_app.insert_row = lambda row, alias, app: rows.append(row)  # type: ignore[assignment]
    built: list[str] = []
    real = RecordingProducer.publish

    def counting(self: RecordingProducer, body: Any, **kwargs: Any) -> None:
        built.append(kwargs["headers"]["id"])
        real(self, body, **kwargs)

    RecordingProducer.publish = counting  # type: ignore[method-assign]
    sends = {
        "delay": lambda tid: add.apply_async((1, 2), task_id=tid, headers={"x-mine": "kept"}),
        "send_task": lambda tid: app.send_task("remote.task", (1,), task_id=tid),
    }
    result: dict[str, Any] = {"wrapper": repr(instrumentation.send_task_wrapper())}
    for name, send in sends.items():
        # One transaction (one trace, one baggage) for the three calls of a shape.
        with sentry_sdk.start_transaction(name=name):
            send(f"{name}-first")  # builds the template
            send(f"{name}-same")  # the template path
            real_check = message_templates._publish_unobserved
            message_templates._publish_unobserved = lambda: False  # type: ignore[assignment]
            try:
                send(f"{name}-same")  # Celery's full path
            finally:
                message_templates._publish_unobserved = real_check  # type: ignore[assignment]
    sentry_sdk.flush()
    result["rows"] = [dataclasses.asdict(row) for row in rows]
    result["built"] = built
    result["spans"] = spans(transport)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
