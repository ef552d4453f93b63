"""The example project's Celery app: an OutboxCelery configured from Django settings.

`celery -A example.project.celery worker` imports this module before anything has set Django
up, and outbox_notify's write side needs the app registry, so Django is set up here first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import django
from celery.signals import worker_process_init, worker_ready
from django.apps import apps
from django.db import connection

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example.project.settings")
if not apps.ready:
    django.setup()

# Imported only now: outbox_notify's write side needs the app registry set up above.
from outbox_notify import OutboxCelery

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
