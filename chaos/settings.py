"""Django settings of the chaos project: the database and broker come from the environment.

CHAOS_DATABASE_URL names the private PostgreSQL database and CHAOS_BROKER_URL the private
Redis; chaos.run sets both before Django starts, and passes them on to the relays and the
worker it spawns.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = "outbox-notify-chaos-only"  # noqa: S105 - a throwaway project on private servers
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_url = urlsplit(os.environ.get("CHAOS_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/chaos"))

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/") or "chaos",
        "USER": unquote(_url.username or "postgres"),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
        # Persistent: the worker would otherwise connect anew for every task it records.
        "CONN_MAX_AGE": None,
    }
}

INSTALLED_APPS = ["outbox_notify", "chaos.ledger"]

OUTBOX_NOTIFY_CELERY_APP = "chaos.celery_app.app"
