"""Lazy, typed access to the OUTBOX_NOTIFY_* settings and their defaults.

Every accessor reads `django.conf.settings` when called, never at import time, so
`override_settings` in tests and late configuration both work. Each setting has one parser
that turns the raw value into what the code uses or says what is wrong with it; the accessors
raise that as a ConfigurationError naming the setting, and the system checks report every
invalid setting at once (`problems()`), each under its own name.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from outbox_notify.exceptions import ConfigurationError

PREFIX = "OUTBOX_NOTIFY_"
DEFAULT_DATABASE = "default"
DEFAULT_DEAD_LETTER_RETENTION_DAYS = 30
# Days OnceTask keys are kept: as long as dead letters, which may be requeued (and delivered
# again) until they are purged. docs/once.md#keeping-keys-retention-and-purge
DEFAULT_INBOX_RETENTION_DAYS = 30
DEFAULT_STATSD_PORT = 8125
# Loopback unless asked: /metrics and /healthz tell anyone who can reach them about the queue.
DEFAULT_METRICS_ADDRESS = "127.0.0.1"
# Bytes of one task's stored JSON (args + kwargs + options). Under RabbitMQ 4's default
# max_message_size (16 MiB; 3.x: 128 MiB) and Redis's proto-max-bulk-len (512 MB) even after
# the Redis transport's base64 (x 4/3) and envelope: see docs/reference.md#settings.
DEFAULT_MAX_MESSAGE_BYTES = 10 * 1024 * 1024
# Seconds. Tasks whose ETA is further ahead stay in the outbox until it (docs/concepts.md,
# "Tasks held until their ETA"): far below RabbitMQ's consumer_timeout (30 min) and Redis's
# visibility_timeout (1 h), far above the relay's sweep interval.
DEFAULT_HOLD_ETA_AFTER = 60.0

T = TypeVar("T")
Redactor = Callable[[str, list[Any], dict[str, Any]], tuple[list[Any], dict[str, Any]]]


class Invalid(ValueError):
    """What is wrong with a setting's value, phrased to follow the setting's name."""


def _get(name: str, default: Any = None) -> Any:
    return getattr(settings, PREFIX + name, default)


def _read(name: str, default: Any, parse: Callable[[Any], T]) -> T:
    """Parse one setting; an invalid value raises ConfigurationError naming the setting."""
    try:
        return parse(_get(name, default))
    except Invalid as exc:
        raise ConfigurationError(f"{PREFIX}{name} {exc}") from None


def _optional_text(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"must be a string or None, not {value!r}")
    return value


def _names(value: Any, what: str) -> frozenset[str]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise Invalid(f"must be a list or tuple of {what}, not {value!r}")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise Invalid(f"must be a list or tuple of {what}, not {value!r}")
    return frozenset(items)


def whole_number(value: Any, *, minimum: int, maximum: int | None = None, unit: str = "") -> int:
    """An int within bounds: bools, floats (nan and inf included) and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"must be a whole number{unit}, not {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise Invalid(f"must be at least {minimum}{upper}{unit}, not {value!r}")
    return value


def finite_number(value: Any, *, minimum: float = 0.0, unit: str = "") -> float:
    """A real number >= minimum; nan and +/-inf are refused (for settings in seconds)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(f"must be a finite number{unit}, not {value!r}")
    if value < minimum:
        raise Invalid(f"must be at least {minimum:g}{unit}, not {value!r}")
    return float(value)


def _database(value: Any) -> str:
    if not isinstance(value, str) or value not in settings.DATABASES:
        raise Invalid(f"must be a key of settings.DATABASES, not {value!r}")
    return value


def _celery_app_path(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"must be a dotted path string such as 'proj.celery.app', not {value!r}")
    return value or None


def _listen_dsn(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"must be a libpq URL or conninfo string, or None, not {value!r}")
    return value


def _structlog_keys(value: Any) -> frozenset[str] | None:
    return None if value is None else _names(value, "key names, or None")


def _retention_days(value: Any) -> int:
    return whole_number(value, minimum=0, unit=" of days")


def _redact(value: Any) -> Redactor | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise Invalid(f"must be a dotted path string or None, not {value!r}")
    try:
        func = import_string(value)
    except ImportError as exc:
        raise Invalid(f"names {value!r}, which cannot be imported: {exc}") from None
    if not callable(func):
        raise Invalid(f"names {value!r}, which is not callable")
    return func  # type: ignore[no-any-return]


def _statsd_port(value: Any) -> int:
    return whole_number(value, minimum=1, maximum=65535)


def _metrics_port(value: Any) -> int | None:
    # 0 asks the kernel for a free port (the relay logs the one it got).
    return None if value is None else whole_number(value, minimum=0, maximum=65535)


def _metrics_address(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"must be an IP address or host name to bind, not {value!r}")
    return value


def _statsd_tags(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        raise Invalid(f"must be a list or tuple of 'key:value' strings, not {value!r}")
    return list(value)


def _max_message_bytes(value: Any) -> int | None:
    return None if value is None else whole_number(value, minimum=1, unit=" of bytes, or None")


def _hold_eta_after(value: Any) -> float | None:
    return None if value is None else finite_number(value, unit=" of seconds, or None")


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be True or False, not {value!r}")
    return value


def _event_source(value: Any) -> str | None:
    # CloudEvents: `source` is a non-empty URI-reference; spaces and control characters
    # cannot be part of one, and a NUL cannot be stored.
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(ch.isspace() or ord(ch) < 32 for ch in value):
        raise Invalid(
            "must be a non-empty URI-reference without spaces (such as "
            f"'https://shop.example.com' or '/shop/orders'), or None, not {value!r}"
        )
    return value


# Every setting outbox-notify reads: (name after the prefix, default, parser). The unknown-
# setting check suggests names from here, so a new setting must be added here too.
SETTINGS: tuple[tuple[str, Any, Callable[[Any], Any]], ...] = (
    ("CELERY_APP", None, _celery_app_path),
    ("DATABASE", DEFAULT_DATABASE, _database),
    ("LISTEN_DSN", None, _listen_dsn),
    ("EXCLUDE_TASKS", (), functools.partial(_names, what="task names")),
    ("STRUCTLOG_CONTEXT_KEYS", None, _structlog_keys),
    ("DEAD_LETTER_RETENTION_DAYS", DEFAULT_DEAD_LETTER_RETENTION_DAYS, _retention_days),
    ("REDACT", None, _redact),
    ("STATSD_HOST", None, _optional_text),
    ("STATSD_PORT", DEFAULT_STATSD_PORT, _statsd_port),
    ("STATSD_PREFIX", None, _optional_text),
    ("STATSD_TAGS", None, _statsd_tags),
    ("METRICS_PORT", None, _metrics_port),
    ("METRICS_ADDRESS", DEFAULT_METRICS_ADDRESS, _metrics_address),
    ("MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES, _max_message_bytes),
    ("HOLD_ETA_AFTER", DEFAULT_HOLD_ETA_AFTER, _hold_eta_after),
    ("INBOX_RETENTION_DAYS", DEFAULT_INBOX_RETENTION_DAYS, _retention_days),
    ("EVENT_SOURCE", None, _event_source),
    ("AUTO_REINDEX", True, _flag),
)
KNOWN_SETTINGS = frozenset(PREFIX + name for name, _, _ in SETTINGS)


def database_alias() -> str:
    """The Django database alias that holds the outbox tables."""
    return _read("DATABASE", DEFAULT_DATABASE, _database)


def celery_app_path() -> str | None:
    """Dotted path to the Celery app the relay publishes with, or None when unset."""
    return _read("CELERY_APP", None, _celery_app_path)


def celery_app() -> Any:
    """Import and return the configured Celery app; required by the relay commands."""
    path = celery_app_path()
    if not path:
        raise ConfigurationError(
            "OUTBOX_NOTIFY_CELERY_APP is not set: name the Celery app the relay publishes "
            "with, e.g. OUTBOX_NOTIFY_CELERY_APP = 'proj.celery.app'"
        )
    try:
        return import_celery_app(path)
    except Invalid as exc:
        raise ConfigurationError(f"OUTBOX_NOTIFY_CELERY_APP {exc}") from exc


def import_celery_app(path: str) -> Any:
    """The object at dotted `path`; Invalid (without the setting's name) when it does not import."""
    try:
        return import_string(path)
    except ImportError as exc:
        raise Invalid(f"names {path!r}, which cannot be imported: {exc}") from exc


def listen_dsn() -> str | None:
    """libpq conninfo/URL for the LISTEN connection, when the alias goes through a pooler."""
    return _read("LISTEN_DSN", None, _listen_dsn)


def exclude_tasks() -> frozenset[str]:
    """Task names that bypass the outbox and go straight to the broker."""
    return _read("EXCLUDE_TASKS", (), functools.partial(_names, what="task names"))


def structlog_context_keys() -> frozenset[str] | None:
    """Which structlog contextvars to capture at enqueue; None means all of them."""
    return _read("STRUCTLOG_CONTEXT_KEYS", None, _structlog_keys)


def dead_letter_retention_days() -> int:
    """Default age, in days, past which dead letters are purged."""
    return _read("DEAD_LETTER_RETENTION_DAYS", DEFAULT_DEAD_LETTER_RETENTION_DAYS, _retention_days)


def inbox_retention_days() -> int:
    """Default age, in days, past which the inbox purge deletes OnceTask keys."""
    return _read("INBOX_RETENTION_DAYS", DEFAULT_INBOX_RETENTION_DAYS, _retention_days)


def redactor() -> Redactor | None:
    """The callable that turns (task_name, args, kwargs) into what admin and logs show."""
    return _read("REDACT", None, _redact)


def statsd() -> dict[str, Any] | None:
    """DogStatsd settings, or None when metrics are off (no host set)."""
    host = _read("STATSD_HOST", None, _optional_text)
    if not host:
        return None
    return {
        "host": host,
        "port": _read("STATSD_PORT", DEFAULT_STATSD_PORT, _statsd_port),
        "namespace": _read("STATSD_PREFIX", None, _optional_text) or None,
        "constant_tags": _read("STATSD_TAGS", None, _statsd_tags),
    }


def metrics_port() -> int | None:
    """The port of the relay's Prometheus endpoint, or None (off unless --metrics-port)."""
    return _read("METRICS_PORT", None, _metrics_port)


def metrics_address() -> str:
    """The address the relay's Prometheus endpoint binds (loopback by default)."""
    return _read("METRICS_ADDRESS", DEFAULT_METRICS_ADDRESS, _metrics_address)


def hold_eta_after() -> float | None:
    """Seconds of ETA beyond which a task is held in the outbox; None: never hold."""
    return _read("HOLD_ETA_AFTER", DEFAULT_HOLD_ETA_AFTER, _hold_eta_after)


def auto_reindex() -> bool:
    """Whether outbox_listen rebuilds the outbox's bloated indexes itself (outbox_notify/index_keeper.py)."""
    return _read("AUTO_REINDEX", True, _flag)


def event_source() -> str:
    """The CloudEvents `source` of the events this service publishes (required to publish)."""
    source = _read("EVENT_SOURCE", None, _event_source)
    if source is None:
        raise ConfigurationError(
            "OUTBOX_NOTIFY_EVENT_SOURCE is not set: name this service as the source of its "
            "domain events, e.g. OUTBOX_NOTIFY_EVENT_SOURCE = 'https://shop.example.com' or "
            "'/shop' (docs/events.md)"
        )
    return source


@functools.cache
def max_message_bytes() -> int | None:
    """The largest task (stored JSON bytes) the write side accepts; None means no limit."""
    # Cached: it is read on every enqueue. setting_changed (override_settings) clears it.
    return _read("MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES, _max_message_bytes)


def _clear_caches(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith(PREFIX):
        max_message_bytes.cache_clear()


setting_changed.connect(_clear_caches, dispatch_uid="outbox_notify.conf.clear_caches")


def problems() -> list[tuple[str, str]]:
    """(setting, what is wrong) for every invalid OUTBOX_NOTIFY_* setting, each once."""
    found: list[tuple[str, str]] = []
    for name, default, parse in SETTINGS:
        try:
            parse(_get(name, default))
        except Invalid as exc:
            found.append((PREFIX + name, str(exc)))
    return found


def unknown_settings() -> list[tuple[str, str | None]]:
    """(setting, closest known name or None) for each OUTBOX_NOTIFY_* name nobody reads."""
    names = sorted(n for n in dir(settings) if n.startswith(PREFIX) and n not in KNOWN_SETTINGS)
    return [(name, closest_setting(name)) for name in names]


def closest_setting(name: str) -> str | None:
    """The known setting a misspelt name most likely meant (compared without the prefix)."""
    suffixes = {known[len(PREFIX) :]: known for known in KNOWN_SETTINGS}
    match = difflib.get_close_matches(name[len(PREFIX) :], suffixes, n=1, cutoff=0.6)
    return suffixes[match[0]] if match else None
