"""System checks: the outbox database, the driver, the settings, the Celery app, the schema.

Check ids are stable and documented in docs/reference.md:

- outbox_notify.E001  the outbox alias is not PostgreSQL
- outbox_notify.E002  psycopg 3 >= 3.2.10 is not the driver in use
- outbox_notify.E003  OUTBOX_NOTIFY_CELERY_APP is set but cannot be imported
- outbox_notify.E004  an OUTBOX_NOTIFY_* setting has an invalid value (one error per setting)
- outbox_notify.E005  OUTBOX_NOTIFY_CELERY_APP is not an OutboxCelery
- outbox_notify.E006  tasks sent in this process would go through an app that is not an
                      OutboxCelery, past the outbox
- outbox_notify.E007  an OutboxCelery's broker transport is unknown to kombu or cannot be loaded
- outbox_notify.E008  an OutboxCelery exists but outbox_notify is not in INSTALLED_APPS
- outbox_notify.E009  the outbox database cannot be reached (database check)
- outbox_notify.W001  the outbox tables are gone although their migrations are recorded
- outbox_notify.W002  the wake-up trigger is missing or disabled
- outbox_notify.W003  an OUTBOX_NOTIFY_* setting outbox-notify does not know (a typo)
- outbox_notify.W004  the outbox tables do not exist: the database was never migrated
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Sequence
from typing import Any

from django.core import checks
from django.db import DatabaseError, connections

from outbox_notify import conf, sql, transport, wiring
from outbox_notify.exceptions import ConfigurationError

MIN_PSYCOPG = (3, 2, 10)
TRIGGER_NAME = "outbox_notify_wake_v1"
FUNCTION_NAME = "outbox_notify_wake_v1"
TABLE_NAME = "outbox_notify_message_v1"
# The migration that adds the inbox, and the one before it (W001's hint rebuilds around a kept
# inbox with them).
INBOX_MIGRATION = "0004_inbox"
BEFORE_INBOX_MIGRATION = "0003_held"
# pg_trigger.tgenabled values under which the trigger fires in ordinary sessions; "R" (replica
# only) and "D" (disabled) leave relays asleep.
TRIGGER_FIRES = ("O", "A")
_LEADING_DIGITS = re.compile(r"\d*")
CELERY_APP = "OUTBOX_NOTIFY_CELERY_APP"


def register() -> None:
    """Register every outbox check with Django's check framework."""
    checks.register(check_settings)
    checks.register(check_task_app)
    checks.register(check_broker)
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
    """Every setting valid and known, the Celery app an importable OutboxCelery, psycopg new."""
    invalid = conf.problems()
    messages: list[checks.CheckMessage] = [
        checks.Error(problem, id="outbox_notify.E004", obj=name) for name, problem in invalid
    ]
    messages.extend(_unknown_settings())
    if all(name != CELERY_APP for name, _ in invalid):
        messages.extend(_check_celery_app())
    messages.extend(_check_psycopg())
    return messages


def _unknown_settings() -> list[checks.CheckMessage]:
    return [
        checks.Warning(
            "is not a setting outbox-notify knows, so it has no effect"
            + (f"; did you mean {closest}?" if closest else ""),
            hint=f"rename it to {closest}" if closest else "remove it (see docs/reference.md)",
            id="outbox_notify.W003",
            obj=name,
        )
        for name, closest in conf.unknown_settings()
    ]


def _check_celery_app() -> list[checks.CheckMessage]:
    path = conf.celery_app_path()
    if not path:
        return []
    try:
        app = conf.import_celery_app(path)
    except conf.Invalid as exc:
        return [checks.Error(str(exc), id="outbox_notify.E003", obj=CELERY_APP)]
    if wiring.is_outbox_app(app):
        return []
    return [
        checks.Error(
            f"names {path!r}, a {type(app).__module__}.{type(app).__qualname__}, not an "
            "OutboxCelery: tasks sent through it go straight to the broker, past the outbox",
            hint="create the app with `from outbox_notify import OutboxCelery` and "
            "`app = OutboxCelery('proj')` in place of `Celery('proj')`",
            id="outbox_notify.E005",
            obj=CELERY_APP,
        )
    ]


def check_task_app(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Tasks sent in this process go through an OutboxCelery, in this thread and in others."""
    current, default = wiring.current_and_default()
    if isinstance(current, wiring.RefusingCelery) or isinstance(default, wiring.RefusingCelery):
        return []  # E003/E005 say why; meanwhile tasks are refused at the call
    if current is not None and not wiring.is_outbox_app(current):
        return [_bypass_error(current, "this thread's current")]
    if not wiring.is_outbox_app(default):
        return [_bypass_error(default, "the default")]
    return []


def _bypass_error(app: Any, where: str) -> checks.CheckMessage:
    shown = "Celery's fallback app" if app is None else f"{app!r} ({type(app).__name__})"
    try:
        configured = conf.celery_app_path()
    except ConfigurationError:
        configured = None
    hint = (
        "some code made another Celery app current after start-up; create other apps with "
        "Celery(..., set_as_current=False)"
        if configured
        else "set OUTBOX_NOTIFY_CELERY_APP = 'proj.celery.app' (the dotted path of your "
        "OutboxCelery): outbox_notify then makes it Celery's current and default app at start-up"
    )
    return checks.Error(
        f"tasks sent in this process would go through {where} Celery app, {shown}, which is "
        "not an OutboxCelery: they would reach the broker at once, past the outbox",
        hint=hint,
        id="outbox_notify.E006",
    )


def _outbox_apps() -> list[Any]:
    """Every OutboxCelery alive in this process, and the one OUTBOX_NOTIFY_CELERY_APP names."""
    from outbox_notify.app import instances

    apps = set(instances)
    with contextlib.suppress(ConfigurationError):  # E003/E004 report a bad setting
        if conf.celery_app_path():
            configured = conf.celery_app()
            if wiring.is_outbox_app(configured):
                apps.add(configured)
    return sorted(apps, key=lambda app: str(app.main))


def check_broker(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E007 for each OutboxCelery whose broker transport kombu cannot load (no connection)."""
    messages: list[checks.CheckMessage] = []
    for app in _outbox_apps():
        found = transport.problem(app)
        if found is not None:
            messages.append(
                checks.Error(found, obj=f"Celery app {app.main!r}", id="outbox_notify.E007")
            )
    return messages


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
        connection.ensure_connection()
    except DatabaseError as exc:
        return [_unreachable(connection.alias, exc, connecting=True)]
    try:
        with connection.cursor() as cursor:
            found = _schema_state(cursor)
    except DatabaseError as exc:
        return [_unreachable(connection.alias, exc, connecting=False)]
    return _schema_messages(connection.alias, found)


def _schema_messages(alias: str, found: dict[str, Any]) -> list[checks.CheckMessage]:
    if not found["table"]:
        if found["migrated"]:
            return [_missing_table(alias, found)]
        # `migrate` runs these checks before it migrates: there, not migrated yet is expected.
        return [] if _inside_migrate() else [_not_migrated(alias)]
    if found["trigger"] not in TRIGGER_FIRES:
        return [_trigger_not_firing(alias, found)]
    return []


def queries() -> sql.Queries:
    """The named queries of sql/checks.sql, loaded once."""
    return sql.load("checks.sql")


def _schema_state(cursor: Any) -> dict[str, Any]:
    cursor.execute(queries()["schema_state"])
    message_table, dead_letter_table, function, trigger, recorder, inbox_table = cursor.fetchone()
    migrated = False
    if recorder:
        cursor.execute(queries()["outbox_migrated"])
        migrated = cursor.fetchone()[0]
    return {
        "table": message_table,
        "dead_letter_table": dead_letter_table,
        "inbox_table": inbox_table,
        "function": function,
        "trigger": trigger,
        "migrated": migrated,
    }


def _database_flag(alias: str) -> str:
    return "" if alias == "default" else f" --database {alias}"


def _unreachable(alias: str, exc: DatabaseError, *, connecting: bool) -> checks.CheckMessage:
    what = "PostgreSQL cannot be reached" if connecting else "its schema could not be inspected"
    return checks.Error(
        f"{what}: {' '.join(str(exc).split())}",
        hint="start the server, or correct its HOST, PORT, NAME, USER or PASSWORD"
        if connecting
        else None,
        obj=f"DATABASES[{alias!r}]",
        id="outbox_notify.E009",
    )


def _inside_migrate() -> bool:
    """Whether Django's `migrate` command (or a subclass) is running these checks.

    `migrate` runs the database checks on the database it is about to migrate, and no
    argument of the check says so: the command is found on the call stack instead.
    """
    from django.core.management.commands.migrate import Command as Migrate

    frame = inspect.currentframe()
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back
    return False


def _not_migrated(alias: str) -> checks.CheckMessage:
    return checks.Warning(
        "the outbox tables do not exist (the database was never migrated): every task sent "
        "through the outbox fails when its row is written",
        hint=f"run: python manage.py migrate{_database_flag(alias)}",
        obj=f"DATABASES[{alias!r}]",
        id="outbox_notify.W004",
    )


def _missing_table(alias: str, found: dict[str, Any]) -> checks.CheckMessage:
    """W001 for tables Django believes migrated: `migrate` alone would do nothing."""
    flag = _database_flag(alias)
    remigrate = f"python manage.py migrate outbox_notify{flag}"
    if found["dead_letter_table"] or found["function"]:
        keys = " and OnceTask keys" if found["inbox_table"] else ""
        hint = (
            "the outbox migrations are recorded as applied but only part of the schema is left; "
            f"save the dead letters{keys} you need, then run: "
            f"python manage.py migrate outbox_notify zero{flag} && {remigrate}"
        )
    elif found["inbox_table"]:
        # Rebuild what precedes the inbox and keep its keys: dropping them would let
        # duplicates of tasks that already ran run again.
        hint = (
            "the outbox migrations are recorded as applied but only the inbox of OnceTask keys "
            "is left; run: "
            f"python manage.py migrate outbox_notify zero --fake{flag} && "
            f"python manage.py migrate outbox_notify {BEFORE_INBOX_MIGRATION}{flag} && "
            f"python manage.py migrate outbox_notify {INBOX_MIGRATION} --fake{flag} && {remigrate}"
        )
    else:
        hint = (
            "the outbox migrations are recorded as applied but the schema is gone; run: "
            f"python manage.py migrate outbox_notify zero --fake{flag} && {remigrate}"
        )
    return checks.Warning(
        f"table {TABLE_NAME} is missing on database {alias!r}", hint=hint, id="outbox_notify.W001"
    )


def _trigger_not_firing(alias: str, found: dict[str, Any]) -> checks.CheckMessage:
    state = {None: "missing", "D": "disabled", "R": "enabled for replica sessions only"}
    return checks.Warning(
        f"trigger {TRIGGER_NAME} is {state.get(found['trigger'], 'not firing')}: relays will "
        "only wake on their sweep timer",
        hint=(
            f"as the owner of {TABLE_NAME} (python manage.py dbshell{_database_flag(alias)}), "
            f"run: {trigger_fix(found)}"
        ),
        id="outbox_notify.W002",
    )


def trigger_fix(found: dict[str, Any]) -> str:
    """The SQL that makes the wake-up trigger fire again, for the state found."""
    if found["trigger"] is not None:
        return f"ALTER TABLE {TABLE_NAME} ENABLE TRIGGER {TRIGGER_NAME};"
    if found["function"]:
        return _trigger_ddl()
    return _function_ddl() + "\n" + _trigger_ddl()


def _statement(marker: str, end: str) -> str:
    """One statement of install.sql, from `marker` up to and including `end`."""
    text = sql.read("install.sql")
    start = text.index(marker)
    return text[start : text.index(end, start) + len(end)]


def _function_ddl() -> str:
    return _statement(f"CREATE FUNCTION {FUNCTION_NAME}()", "$$;")


def _trigger_ddl() -> str:
    return " ".join(_statement(f"CREATE TRIGGER {TRIGGER_NAME}", ";").split())
