"""Lazy, typed access to the OUTBOX_NOTIFY_* settings and their defaults.

Every accessor reads `django.conf.settings` when called, never at import time, so
`override_settings` in tests and late configuration both work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from outbox_notify.exceptions import ConfigurationError

PREFIX = "OUTBOX_NOTIFY_"
DEFAULT_DATABASE = "default"
DEFAULT_DEAD_LETTER_RETENTION_DAYS = 30
DEFAULT_STATSD_PORT = 8125
# Seconds. Tasks whose ETA is further ahead stay in the outbox until it (docs/concepts.md,
# "Tasks held until their ETA"): far below RabbitMQ's consumer_timeout (30 min) and Redis's
# visibility_timeout (1 h), far above the relay's sweep interval.
DEFAULT_HOLD_ETA_AFTER = 60.0

Redactor = Callable[[str, list[Any], dict[str, Any]], tuple[list[Any], dict[str, Any]]]


def _get(name: str, default: Any = None) -> Any:
    return getattr(settings, PREFIX + name, default)


def database_alias() -> str:
    """The Django database alias that holds the outbox tables."""
    value = _get("DATABASE", DEFAULT_DATABASE)
    if not isinstance(value, str) or value not in settings.DATABASES:
        raise ConfigurationError(
            f"OUTBOX_NOTIFY_DATABASE={value!r} is not a key of settings.DATABASES"
        )
    return value


def celery_app_path() -> str | None:
    """Dotted path to the Celery app the relay publishes with, or None when unset."""
    value = _get("CELERY_APP")
    if value is not None and not isinstance(value, str):
        raise ConfigurationError("OUTBOX_NOTIFY_CELERY_APP must be a dotted path string")
    return value


def celery_app() -> Any:
    """Import and return the relay's Celery app; required by the relay commands."""
    path = celery_app_path()
    if not path:
        raise ConfigurationError(
            "OUTBOX_NOTIFY_CELERY_APP is not set: name the Celery app the relay publishes "
            "with, e.g. OUTBOX_NOTIFY_CELERY_APP = 'proj.celery.app'"
        )
    try:
        return import_string(path)
    except ImportError as exc:
        raise ConfigurationError(
            f"OUTBOX_NOTIFY_CELERY_APP={path!r} cannot be imported: {exc}"
        ) from exc


def listen_dsn() -> str | None:
    """libpq conninfo/URL for the LISTEN connection, when the alias goes through a pooler."""
    value = _get("LISTEN_DSN")
    if value is not None and not isinstance(value, str):
        raise ConfigurationError("OUTBOX_NOTIFY_LISTEN_DSN must be a libpq URL or conninfo string")
    return value


def exclude_tasks() -> frozenset[str]:
    """Task names that bypass the outbox and go straight to the broker."""
    value = _get("EXCLUDE_TASKS", ())
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigurationError(
            "OUTBOX_NOTIFY_EXCLUDE_TASKS must be a list or tuple of task names"
        )
    return frozenset(value)


def structlog_context_keys() -> frozenset[str] | None:
    """Which structlog contextvars to capture at enqueue; None means all of them."""
    value = _get("STRUCTLOG_CONTEXT_KEYS")
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigurationError(
            "OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS must be None or a list or tuple of key names"
        )
    return frozenset(value)


def dead_letter_retention_days() -> int:
    """Default age, in days, past which dead letters are purged."""
    value = _get("DEAD_LETTER_RETENTION_DAYS", DEFAULT_DEAD_LETTER_RETENTION_DAYS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            "OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS must be a whole number of days >= 0"
        )
    return value


def redactor() -> Redactor | None:
    """The callable that turns (task_name, args, kwargs) into what admin and logs show."""
    path = _get("REDACT")
    if path is None:
        return None
    if not isinstance(path, str):
        raise ConfigurationError("OUTBOX_NOTIFY_REDACT must be a dotted path string")
    try:
        func = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(
            f"OUTBOX_NOTIFY_REDACT={path!r} cannot be imported: {exc}"
        ) from exc
    if not callable(func):
        raise ConfigurationError(f"OUTBOX_NOTIFY_REDACT={path!r} is not callable")
    return func  # type: ignore[no-any-return]


def statsd() -> dict[str, Any] | None:
    """DogStatsd settings, or None when metrics are off (no host set)."""
    host = _get("STATSD_HOST")
    if not host:
        return None
    tags = _get("STATSD_TAGS") or ()
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise ConfigurationError(
            "OUTBOX_NOTIFY_STATSD_TAGS must be a list or tuple of 'key:value' strings"
        )
    return {
        "host": str(host),
        "port": int(_get("STATSD_PORT", DEFAULT_STATSD_PORT)),
        "namespace": _get("STATSD_PREFIX") or None,
        "constant_tags": [str(t) for t in tags],
    }


def hold_eta_after() -> float | None:
    """Seconds of ETA beyond which a task is held in the outbox; None: never hold."""
    value = _get("HOLD_ETA_AFTER", DEFAULT_HOLD_ETA_AFTER)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigurationError(
            f"OUTBOX_NOTIFY_HOLD_ETA_AFTER must be a finite number of seconds >= 0, or None "
            f"to never hold tasks, not {value!r}"
        )
    return float(value)


def validate_all() -> list[tuple[str, str]]:
    """Read every setting once; return (setting, message) for each invalid one."""
    problems: list[tuple[str, str]] = []
    checks: list[tuple[str, Callable[[], object]]] = [
        ("OUTBOX_NOTIFY_DATABASE", database_alias),
        ("OUTBOX_NOTIFY_CELERY_APP", celery_app_path),
        ("OUTBOX_NOTIFY_LISTEN_DSN", listen_dsn),
        ("OUTBOX_NOTIFY_EXCLUDE_TASKS", exclude_tasks),
        ("OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS", structlog_context_keys),
        ("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", dead_letter_retention_days),
        ("OUTBOX_NOTIFY_REDACT", redactor),
        ("OUTBOX_NOTIFY_STATSD_PORT", statsd),
        ("OUTBOX_NOTIFY_HOLD_ETA_AFTER", hold_eta_after),
    ]
    for name, read in checks:
        try:
            read()
        except (ConfigurationError, ValueError, TypeError) as exc:
            problems.append((name, str(exc)))
    return problems
