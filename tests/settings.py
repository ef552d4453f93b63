"""Django settings for the test suite and for the relay subprocesses it starts.

The database comes from OUTBOX_TEST_DATABASE_URL when set (conftest sets it for the private
server it starts, and for subprocesses); OUTBOX_TEST_DB_NAME names the database to use in
subprocesses (the test database pytest-django created).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import django

SECRET_KEY = "outbox-notify-tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _default_url() -> str:
    # libpq's variables, when set, name the server (bench/trigger.py --relay-cmd sets them).
    user = os.environ.get("PGUSER", "postgres")
    host = os.environ.get("PGHOST", "127.0.0.1")
    return f"postgresql://{user}@{host}:{os.environ.get('PGPORT', '5432')}/postgres"


_url = urlsplit(os.environ.get("OUTBOX_TEST_DATABASE_URL") or _default_url())
_db_name = os.environ.get("OUTBOX_TEST_DB_NAME") or os.environ.get("PGDATABASE") or "outbox_notify"


def _database(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": _url.username or "postgres",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
        "TEST": {"NAME": name if "OUTBOX_TEST_DB_NAME" in os.environ else None},
    }


DATABASES = {
    "default": _database(_db_name),
    "other": _database(_db_name + "_other"),
}
if django.VERSION >= (5, 1):
    # The default database behind Django's connection pool (OPTIONS["pool"], from 5.1), of one
    # connection: a psycopg connection given back is the next borrower's
    # (tests/integration/test_deferred_rows.py). Nothing connects through it unless a test does.
    DATABASES["pooled"] = {
        **_database(_db_name),
        "OPTIONS": {"pool": {"min_size": 1, "max_size": 1, "timeout": 30}},
        "TEST": {"MIRROR": "default"},
    }

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # The admin's CSS in the dashboard's browser test (its screenshot is in docs/operations.md).
    "django.contrib.staticfiles",
    "outbox_notify",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

OUTBOX_NOTIFY_CELERY_APP = "tests.celery_app.app"
# Set by tests that put the alias behind a transaction pooler (tests/integration/test_pgbouncer.py).
OUTBOX_NOTIFY_LISTEN_DSN = os.environ.get("OUTBOX_TEST_LISTEN_DSN") or None
# Set by tests that receive the relay's StatsD datagrams (tests/integration/test_relay_role.py).
OUTBOX_NOTIFY_STATSD_HOST = os.environ.get("OUTBOX_TEST_STATSD_HOST") or None
OUTBOX_NOTIFY_STATSD_PORT = int(os.environ.get("OUTBOX_TEST_STATSD_PORT") or 8125)
# The CloudEvents `source` of the events the tests publish (outbox_notify.events.publish).
OUTBOX_NOTIFY_EVENT_SOURCE = "/tests/outbox-notify"

# The admin dashboard's browser test (tests/integration/test_dashboard_browser.py) runs a live
# server, whose static files handler needs a URL prefix even with no static files app.
STATIC_URL = "/static/"
