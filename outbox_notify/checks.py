"""System checks: the outbox database, the driver, the settings, the schema.

Check ids are stable and documented in docs/reference.md:

- outbox_notify.E001  the outbox alias is not PostgreSQL
- outbox_notify.E002  psycopg 3 >= 3.2.10 is not the driver in use
- outbox_notify.E003  OUTBOX_NOTIFY_CELERY_APP is set but cannot be imported
- outbox_notify.E004  an OUTBOX_NOTIFY_* setting has an invalid value
- outbox_notify.W001  the outbox tables are missing (migrations not applied)
- outbox_notify.W002  the wake-up trigger is missing or disabled
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from django.core import checks
from django.db import DatabaseError, connections

from outbox_notify import conf
from outbox_notify.exceptions import ConfigurationError

MIN_PSYCOPG = (3, 2, 10)
TRIGGER_NAME = "outbox_notify_wake_v1"
TABLE_NAME = "outbox_notify_message_v1"
# pg_trigger.tgenabled values under which the trigger fires in ordinary sessions; "R" (replica
# only) and "D" (disabled) leave relays asleep.
TRIGGER_FIRES = ("O", "A")
_LEADING_DIGITS = re.compile(r"\d*")


def register() -> None:
    """Register every outbox check with Django's check framework."""
    checks.register(check_settings)
    checks.register(check_database_vendor, checks.Tags.database)
    checks.register(check_schema, checks.Tags.database)
    from outbox_notify.app import check_task_protocol  # the write side's own check (E010)

    checks.register(check_task_protocol)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        # Leading digits only: "9rc1" is 9, not 91.
        digits = _LEADING_DIGITS.match(piece)
        parts.append(int(digits.group() or 0) if digits else 0)
    return tuple(parts)


def check_settings(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Every setting readable, the Celery app importable, psycopg recent enough."""
    errors: list[checks.CheckMessage] = [
        checks.Error(f"{name}: {message}", id="outbox_notify.E004", obj=name)
        for name, message in conf.validate_all()
    ]
    app_setting_valid = all(error.obj != "OUTBOX_NOTIFY_CELERY_APP" for error in errors)
    if app_setting_valid and conf.celery_app_path():
        try:
            conf.celery_app()
        except ConfigurationError as exc:
            errors.append(
                checks.Error(str(exc), id="outbox_notify.E003", obj="OUTBOX_NOTIFY_CELERY_APP")
            )
    errors.extend(_check_psycopg())
    return errors


def _check_psycopg() -> list[checks.CheckMessage]:
    try:
        import psycopg
    except ImportError:
        return [checks.Error("psycopg 3 is not installed", id="outbox_notify.E002")]
    if _version_tuple(psycopg.__version__) < MIN_PSYCOPG:
        return [
            checks.Error(
                f"psycopg {psycopg.__version__} is too old; outbox-notify needs >= 3.2.10",
                id="outbox_notify.E002",
            )
        ]
    return []


def _outbox_connection() -> Any:
    try:
        return connections[conf.database_alias()]
    except ConfigurationError:
        return None  # reported by check_settings


def check_database_vendor(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """The outbox alias must be a PostgreSQL database on psycopg 3."""
    connection = _outbox_connection()
    if connection is None:
        return []
    if connection.vendor != "postgresql":
        return [
            checks.Error(
                f"database alias {connection.alias!r} is {connection.vendor}; the outbox needs PostgreSQL",
                id="outbox_notify.E001",
            )
        ]
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        return [
            checks.Error(
                "the PostgreSQL backend uses psycopg2; install psycopg 3", id="outbox_notify.E002"
            )
        ]
    return []


def check_schema(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn when the outbox table or its trigger is missing on the outbox database."""
    connection = _outbox_connection()
    if connection is None or connection.vendor != "postgresql":
        return []
    # Django's rule for database checks: without a list of databases, touch none.
    if databases is None or connection.alias not in databases:
        return []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [TABLE_NAME])
            table_exists = cursor.fetchone()[0]
            cursor.execute(
                "SELECT tgenabled FROM pg_trigger WHERE tgname = %s AND NOT tgisinternal",
                [TRIGGER_NAME],
            )
            trigger = cursor.fetchone()
    except DatabaseError:
        return []  # an unreachable database is reported by Django itself
    if not table_exists:
        return [
            checks.Warning(
                f"table {TABLE_NAME} is missing on database {connection.alias!r}",
                hint="run: python manage.py migrate outbox_notify",
                id="outbox_notify.W001",
            )
        ]
    if trigger is None or trigger[0] not in TRIGGER_FIRES:
        return [
            checks.Warning(
                f"trigger {TRIGGER_NAME} is missing or disabled: relays will only wake on their sweep timer",
                hint="run: python manage.py migrate outbox_notify (or psql -f sql/install.sql)",
                id="outbox_notify.W002",
            )
        ]
    return []
