"""A plain celery.Celery app with the canvas tasks: what the canvas tests compare against.

Its worker (`celery -A tests.plain_canvas worker`) and the test process publish straight to
the broker, as any Celery project without outbox-notify does.
"""

from __future__ import annotations

import os

import celery

from tests.canvas_tasks import register

app = celery.Celery("plain-canvas", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("OUTBOX_TEST_BROKER_URL", "redis://127.0.0.1:6379/15"),
    result_backend=os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    task_default_queue=os.environ.get("OUTBOX_TEST_QUEUE", "outbox-notify-plain-canvas"),
    broker_connection_retry_on_startup=False,
    broker_connection_timeout=3,
    enable_utc=True,
)
tasks = register(app)
