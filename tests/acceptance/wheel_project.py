"""A throwaway Django project laid out as docs/install.md shows, for the installed wheel to run.

`proj/__init__.py` imports the Celery module, `manage.py` sits beside the package, and the
settings read what each test varies (database, broker, queue, StatsD, Sentry) from WHEEL_*
variables, so the same files serve `migrate`, the relay, the worker and the enqueueing shell.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg

MANAGE = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wheelproj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

INIT = """\
from .celery import app as celery_app

__all__ = ("celery_app",)
"""

CELERY = """\
import os

from outbox_notify import OutboxCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wheelproj.settings")

app = OutboxCelery("wheelproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

TASKS = """\
import json
import os

from celery import shared_task


@shared_task(bind=True, name="wheelproj.record")
def record(self, marker):
    entry = {
        "id": self.request.id,
        "marker": marker,
        "sentry_trace": self.request.get("sentry-trace"),
    }
    with open(os.environ["WHEEL_RECORD_FILE"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\\n")
"""

SETTINGS = """\
import os

SECRET_KEY = "wheel-test"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "outbox_notify", "wheelproj"]
OUTBOX_NOTIFY_CELERY_APP = "wheelproj.celery.app"
DATABASES = {{
    "default": {{
        "ENGINE": "django.db.backends.postgresql",
        "NAME": {name!r},
        "USER": {user!r},
        "PASSWORD": {password!r},
        "HOST": {host!r},
        "PORT": {port!r},
    }}
}}
CELERY_BROKER_URL = os.environ.get("WHEEL_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("WHEEL_QUEUE", "celery")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = False
OUTBOX_NOTIFY_STATSD_HOST = os.environ.get("WHEEL_STATSD_HOST") or None
OUTBOX_NOTIFY_STATSD_PORT = int(os.environ.get("WHEEL_STATSD_PORT") or 8125)
OUTBOX_NOTIFY_METRICS_PORT = int(os.environ.get("WHEEL_METRICS_PORT") or 0) or None

if os.environ.get("WHEEL_SENTRY_DSN"):
    import sentry_sdk

    sentry_sdk.init(dsn=os.environ["WHEEL_SENTRY_DSN"], traces_sample_rate=1.0)
"""

# Enqueues one task the way a view does, in a transaction; prints its id last.
ENQUEUE = """\
from django.db import transaction

from wheelproj.tasks import record

with transaction.atomic():
    result = record.delay("from-the-wheel")
print(result.id)
"""


def write(project: Path, server_url: str, dbname: str) -> None:
    """Write the project into `project` (created), using database `dbname` on `server_url`."""
    parts = psycopg.conninfo.conninfo_to_dict(server_url)
    package = project / "wheelproj"
    package.mkdir(parents=True)
    (project / "manage.py").write_text(MANAGE)
    (package / "__init__.py").write_text(INIT)
    (package / "celery.py").write_text(CELERY)
    (package / "tasks.py").write_text(TASKS)
    (package / "settings.py").write_text(
        SETTINGS.format(
            name=dbname,
            user=str(parts.get("user") or "postgres"),
            password=str(parts.get("password") or ""),
            host=str(parts.get("host") or "127.0.0.1"),
            port=str(parts.get("port") or "5432"),
        )
    )


def clean_env() -> dict[str, str]:
    """This environment without anything that could lead Python to the checkout or its venv,
    or configure Celery or Django from outside the project."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
        and not key.startswith(("DJANGO_", "OUTBOX_", "CELERY_", "WHEEL_"))
    }
