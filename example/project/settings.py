"""Django settings of the example project, taken from the environment.

- DATABASE_URL: a libpq URL, `postgresql://user:password@host:port/dbname?sslmode=...`.
- CELERY_BROKER_URL: any kombu broker URL (`redis://...`, `amqp://...`, `filesystem://`).
- CELERY_BROKER_TRANSPORT: optional kombu transport class (`module:Class`) that overrides the
  URL's scheme; the demo names its atomic filesystem transport here.
- CELERY_BROKER_TRANSPORT_OPTIONS: optional JSON object of kombu transport options (the demo
  sets the folders of the filesystem transport here).
- CELERY_TASK_DEFAULT_QUEUE: the queue tasks go to and the worker consumes (default
  `outbox-notify-demo`, so the demo never mixes with other workers on a shared broker).
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/outbox_notify_example"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


def database_from_url(url: str) -> dict[str, Any]:
    """A Django DATABASES entry from a libpq URL; query parameters become libpq options."""
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"DATABASE_URL must be a postgresql:// URL, not {parts.scheme}://")
    options = dict(parse_qsl(parts.query))
    host = unquote(parts.hostname or "") or options.pop("host", "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "OPTIONS": options,
        # Worker processes keep their connection between tasks instead of reconnecting.
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
    }


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-a-secret")
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": database_from_url(os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL))}

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "outbox_notify",
    "example.shop",
]

OUTBOX_NOTIFY_CELERY_APP = "example.project.celery.app"

# Read by example/project/celery.py through config_from_object(namespace="CELERY").
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", DEFAULT_BROKER_URL)
CELERY_BROKER_TRANSPORT = os.environ.get("CELERY_BROKER_TRANSPORT") or None
CELERY_BROKER_TRANSPORT_OPTIONS = json.loads(
    os.environ.get("CELERY_BROKER_TRANSPORT_OPTIONS") or "{}"
)
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "outbox-notify-demo")
# Domain events (example/shop/events.py): where OrderPlaced goes, and whether it is published
# (the demo turns it off on kombu's filesystem transport, whose exchange bindings live in
# each process and so cannot route from the relay to the consumer).
SHOP_EVENTS_EXCHANGE = os.environ.get("SHOP_EVENTS_EXCHANGE", "outbox-notify-demo.events")
SHOP_PUBLISH_EVENTS = os.environ.get("SHOP_PUBLISH_EVENTS", "1") == "1"
OUTBOX_NOTIFY_EVENT_SOURCE = "/outbox-notify/example-shop"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's Django fixup otherwise closes the database connection before and after every task,
# so each task would pay for a new PostgreSQL connection (tens of ms on a busy machine).
CELERY_DB_REUSE_MAX = 1000  # tasks per connection
CELERY_ENABLE_UTC = True
