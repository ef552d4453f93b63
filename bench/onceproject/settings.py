"""Django settings of the bench.once worker, from BENCH_ONCE_* environment variables."""

from __future__ import annotations

import os

SECRET_KEY = "outbox-notify-bench-only"  # noqa: S105 - a throwaway project
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_ONCE_DB_NAME", "postgres"),
        "USER": os.environ.get("BENCH_ONCE_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("BENCH_ONCE_DB_PASSWORD", ""),
        "HOST": os.environ.get("BENCH_ONCE_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("BENCH_ONCE_DB_PORT", "5432"),
        # Persistent, so only Celery's fixup decides when the connection closes (see app.py).
        "CONN_MAX_AGE": None,
        # The benchmark finds the worker's backend by this name, to read its CPU time.
        "OPTIONS": {"application_name": "bench.once.worker"},
    }
}

INSTALLED_APPS = ["outbox_notify"]

OUTBOX_NOTIFY_CELERY_APP = "bench.onceproject.app.app"
