"""The chaos project's Celery app: one task that records each execution in the ledger."""

from __future__ import annotations

import os
from typing import Any

import django
from django.apps import apps

# The worker imports this module before anything sets Django up; outbox_notify's app config
# imports it while Django is setting up (apps.loading), when it must not set up again.
if not apps.ready and not apps.loading:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chaos.settings")
    django.setup()

from outbox_notify import OutboxCelery  # after setup: it needs the app registry

# Unacknowledged messages (a worker that lost its broker connection) come back after this
# long; short, so a run drains in seconds instead of Redis's default hour.
VISIBILITY_TIMEOUT = 10  # seconds

app = OutboxCelery("chaos")
app.conf.update(
    broker_url=os.environ.get("CHAOS_BROKER_URL", "redis://127.0.0.1:1/0"),
    task_default_queue=os.environ.get("CHAOS_QUEUE", "chaos"),
    # Acknowledge after the ledger row is written: a task whose insert failed is redelivered.
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=16,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_hijack_root_logger=False,
    enable_utc=True,
)


@app.task(name="chaos.record", bind=True)
def record(self: Any, scenario: str, seq: int) -> None:
    """Record one execution of this task id (first time, or once more) in the ledger."""
    from chaos.ledger.record import record_execution

    request = self.request
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    record_execution(str(request.id), scenario, redelivered=redelivered)
