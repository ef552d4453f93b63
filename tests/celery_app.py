"""The Celery app the test suite and the relay subprocesses share."""

from __future__ import annotations

import os

from outbox_notify import OutboxCelery
from tests.canvas_tasks import register as register_canvas_tasks

app = OutboxCelery("tests")
app.conf.update(
    broker_url=os.environ.get("OUTBOX_TEST_BROKER_URL", "redis://127.0.0.1:6379/15"),
    # Chords need a result backend; enqueueing never contacts it (OutboxCelery skips the
    # backend's send-time subscription), so a default that may be down is harmless.
    result_backend=os.environ.get("OUTBOX_TEST_RESULT_BACKEND")
    or os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    task_default_queue=os.environ.get("OUTBOX_TEST_QUEUE", "outbox-notify-tests"),
    broker_connection_retry_on_startup=False,
    broker_connection_timeout=3,
    enable_utc=True,
    # The OnceTask tasks; a module of their own, imported by the worker at start.
    include=["tests.once_tasks"],
)
if os.environ.get("OUTBOX_TEST_TIMEZONE"):
    # Workers and relays of tests about times in an app whose timezone is not UTC.
    app.conf.timezone = os.environ["OUTBOX_TEST_TIMEZONE"]
if os.environ.get("OUTBOX_TEST_VISIBILITY_TIMEOUT"):
    # Crash tests (on a private Redis): unacknowledged messages of a killed worker come back
    # after this many seconds instead of Redis's default hour.
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["OUTBOX_TEST_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }


@app.task(name="tests.add")
def add(x: int, y: int) -> int:
    """A task to enqueue in tests."""
    return x + y


@app.task(name="tests.fail")
def fail(*args: object, **kwargs: object) -> None:
    """A task that always raises (drives link_error)."""
    raise RuntimeError("tests.fail always fails")


@app.task(name="tests.record")
def record(*args: object, **kwargs: object) -> str:
    """A task that records its execution (used with a real worker) and returns a marker."""
    from tests.testapp.tasks import record_execution

    record_execution(args, kwargs)
    return "recorded"


@app.task(name="tests.record_direct")
def record_direct(*args: object, **kwargs: object) -> str:
    """tests.record under another name, for tests that list it in OUTBOX_NOTIFY_EXCLUDE_TASKS."""
    from tests.testapp.tasks import record_execution

    record_execution(args, kwargs)
    return "recorded"


# The canvas tests' tasks; tests/plain_canvas.py makes the same ones on a plain Celery app.
canvas = register_canvas_tasks(app)
