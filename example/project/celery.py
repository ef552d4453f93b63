"""The example project's Celery app: an OutboxCelery configured from Django settings.

Laid out as Celery's Django guide does: DJANGO_SETTINGS_MODULE set before the app is created
(so `celery -A example.project.celery worker` finds the settings and sets Django up itself),
and no django.setup() here: outbox_notify's app config imports this module while Django
starts, to make `app` the Celery app every task goes through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery.signals import worker_process_init, worker_ready
from django.db import connection

from outbox_notify import OutboxCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example.project.settings")

# The demo waits for this file (named in the worker's environment) before placing orders.
READY_FILE_ENV = "EXAMPLE_WORKER_READY_FILE"

app = OutboxCelery("example")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def announce_ready(**kwargs: Any) -> None:
    """Touch the ready file once the worker consumes its queues (its queues are declared)."""
    path = os.environ.get(READY_FILE_ENV)
    if path:
        Path(path).touch()


@worker_process_init.connect
def connect_early(**kwargs: Any) -> None:
    """Open each pool process's database connection at start, not during its first task."""
    connection.ensure_connection()
