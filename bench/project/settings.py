"""Django settings of the benchmark project, filled in from BENCH_* environment variables.

bench.run sets them for every process it starts. Each library keeps its tables in its own
database, so neither relay ever sees the other's rows:

    default  django-celery-outbox (its relay runs its transactions on the default alias)
    ours     outbox-notify (OUTBOX_NOTIFY_DATABASE)

BENCH_PEER=0 leaves django-celery-outbox out entirely (it need not be installed then).
"""

from __future__ import annotations

import os

SECRET_KEY = "outbox-notify-bench-only"  # noqa: S105 - a throwaway project
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PEER_ENABLED = os.environ.get("BENCH_PEER", "1") == "1"


def _database(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": os.environ.get("BENCH_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("BENCH_DB_PASSWORD", ""),
        "HOST": os.environ.get("BENCH_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("BENCH_DB_PORT", "5432"),
    }


DATABASES = {
    "default": _database(os.environ.get("BENCH_PEER_DB", "outbox_bench_peer")),
    "ours": _database(os.environ.get("BENCH_OURS_DB", "outbox_bench_ours")),
}
DATABASE_ROUTERS = ["bench.project.routers.ByLibrary"]

INSTALLED_APPS = [
    "outbox_notify",
    *(["django_celery_outbox"] if PEER_ENABLED else []),
    "bench.project.benchapp",
]

OUTBOX_NOTIFY_CELERY_APP = "bench.project.celery_apps.ours_app"
OUTBOX_NOTIFY_DATABASE = "ours"
CELERY_OUTBOX_APP = "bench.project.celery_apps.peer_app"

# The broker of the scenario that started the process (bench.run sets it: Redis or RabbitMQ).
BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
OURS_QUEUE = os.environ.get("BENCH_OURS_QUEUE", "bench-ours")
PEER_QUEUE = os.environ.get("BENCH_PEER_QUEUE", "bench-peer")
