"""The system checks: each id fires for its cause, names what is wrong, and stays quiet otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from outbox_notify import checks

SQLITE_ALIAS = "outbox_sqlite"
TABLE = "outbox_notify_message_v1"
TRIGGER = "outbox_notify_wake_v1"


def _ids(messages: list[django_checks.CheckMessage]) -> list[str]:
    return [message.id for message in messages if message.id]


def _outbox_messages() -> list[django_checks.CheckMessage]:
    """Every outbox message Django's registry reports, database checks included."""
    found = django_checks.run_checks(databases=["default"])
    return [m for m in found if m.id and m.id.startswith("outbox_notify.")]


@contextlib.contextmanager
def _schema_changed(statement: str) -> Iterator[None]:
    """Run DDL on the test database for the length of the block, then roll it back."""
    # PostgreSQL's DDL is transactional, and the checks use this same connection, so they see
    # the change while no other connection (or later test) ever does.
    with transaction.atomic():
        with connections["default"].cursor() as cursor:
            cursor.execute(statement)
        yield
        transaction.set_rollback(True)


@pytest.fixture
def sqlite_alias() -> Iterator[str]:
    """An extra database alias, configured for SQLite, removed again after the test."""
    # Added to the DATABASES dict in place, not with override_settings: Django warns that
    # overriding DATABASES is unreliable (and warnings are errors here), and the connection
    # handler reads this very dict. Nothing ever connects: the vendor is a class attribute.
    settings.DATABASES[SQLITE_ALIAS] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    try:
        yield SQLITE_ALIAS
    finally:
        with contextlib.suppress(AttributeError):
            del connections[SQLITE_ALIAS]
        del settings.DATABASES[SQLITE_ALIAS]


@pytest.mark.django_db
def test_a_correct_setup_reports_nothing() -> None:
    """With the test settings and a migrated database, no outbox check reports anything."""
    assert _outbox_messages() == []


def test_checks_are_registered_with_django() -> None:
    """The app's ready() registers all three checks, the schema and vendor ones as database checks."""
    registered = django_checks.registry.registry.get_checks()
    assert {checks.check_settings, checks.check_database_vendor, checks.check_schema} <= set(
        registered
    )
    for check in (checks.check_database_vendor, checks.check_schema):
        assert "database" in getattr(check, "tags", ())


def test_e001_when_the_outbox_alias_is_not_postgresql(sqlite_alias: str) -> None:
    """E001 names the alias and its vendor when OUTBOX_NOTIFY_DATABASE is not PostgreSQL."""
    with override_settings(OUTBOX_NOTIFY_DATABASE=sqlite_alias):
        errors = checks.check_database_vendor()
        assert checks.check_schema(databases=[sqlite_alias]) == []
    assert _ids(errors) == ["outbox_notify.E001"]
    assert repr(sqlite_alias) in errors[0].msg
    assert "sqlite" in errors[0].msg


@pytest.mark.parametrize("version", ["3.1.18", "3.2.9", "3.2.9rc1", "3.2.1b10", "3.2"])
def test_e002_when_psycopg_is_too_old(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """E002 for every psycopg older than 3.2.10, pre-releases and short versions included."""
    monkeypatch.setattr(psycopg, "__version__", version)
    errors = [e for e in checks.check_settings() if e.id == "outbox_notify.E002"]
    assert len(errors) == 1
    assert version in errors[0].msg


@pytest.mark.parametrize("version", ["3.2.10", "3.2.10.dev1", "3.3.0", "4.0.0b1"])
def test_no_e002_for_a_recent_psycopg(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """psycopg 3.2.10 and later pass."""
    monkeypatch.setattr(psycopg, "__version__", version)
    assert "outbox_notify.E002" not in _ids(checks.check_settings())


@pytest.mark.parametrize(
    "path", ["tests.no_such_module.app", "tests.celery_app.no_such_app"], ids=["module", "attr"]
)
def test_e003_when_the_celery_app_cannot_be_imported(path: str) -> None:
    """E003, naming the path, when OUTBOX_NOTIFY_CELERY_APP is set but does not import."""
    with override_settings(OUTBOX_NOTIFY_CELERY_APP=path):
        errors = checks.check_settings()
    assert _ids(errors) == ["outbox_notify.E003"]
    assert errors[0].obj == "OUTBOX_NOTIFY_CELERY_APP"
    assert path in errors[0].msg


def test_no_e003_while_the_celery_app_is_unset() -> None:
    """An unset OUTBOX_NOTIFY_CELERY_APP is no error: only the relay commands need it."""
    with override_settings(OUTBOX_NOTIFY_CELERY_APP=None):
        assert checks.check_settings() == []


def _invalid(setting: str, value: Any, case: str, **extra: Any) -> Any:
    return pytest.param(setting, {setting: value, **extra}, id=f"{setting[14:]}-{case}")


INVALID_SETTINGS = [
    _invalid("OUTBOX_NOTIFY_DATABASE", "no_such_alias", "unknown-alias"),
    _invalid("OUTBOX_NOTIFY_DATABASE", ["default"], "not-a-string"),
    _invalid("OUTBOX_NOTIFY_CELERY_APP", 42, "not-a-string"),
    _invalid("OUTBOX_NOTIFY_LISTEN_DSN", 5432, "not-a-string"),
    _invalid("OUTBOX_NOTIFY_EXCLUDE_TASKS", "tests.add", "a-string"),
    _invalid("OUTBOX_NOTIFY_EXCLUDE_TASKS", [1], "not-names"),
    _invalid("OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS", "request_id", "a-string"),
    _invalid("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", -1, "negative"),
    _invalid("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", 1.5, "fraction"),
    _invalid("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", True, "bool"),
    _invalid("OUTBOX_NOTIFY_REDACT", "tests.no_such_module.redact", "not-importable"),
    _invalid("OUTBOX_NOTIFY_REDACT", "tests.settings.SECRET_KEY", "not-callable"),
    _invalid(
        "OUTBOX_NOTIFY_STATSD_PORT", "statsd", "not-a-number", OUTBOX_NOTIFY_STATSD_HOST="127.0.0.1"
    ),
]


@pytest.mark.parametrize(("setting", "overrides"), INVALID_SETTINGS)
def test_e004_names_each_invalid_setting(setting: str, overrides: dict[str, Any]) -> None:
    """One E004 per invalid OUTBOX_NOTIFY_* value, whose object and message name the setting."""
    with override_settings(**overrides):
        errors = checks.check_settings()
    assert _ids(errors) == ["outbox_notify.E004"]
    assert errors[0].obj == setting
    assert errors[0].msg.startswith(f"{setting}: ")


@pytest.mark.django_db
def test_a_bad_outbox_alias_is_reported_once_and_the_database_checks_stand_down() -> None:
    """With OUTBOX_NOTIFY_DATABASE invalid, only E004 speaks: the database checks return nothing."""
    with override_settings(OUTBOX_NOTIFY_DATABASE="no_such_alias"):
        assert _ids(_outbox_messages()) == ["outbox_notify.E004"]


@pytest.mark.django_db
def test_w001_when_the_outbox_table_is_missing() -> None:
    """W001, with the migrate hint, when the outbox table does not exist (W002 is not piled on)."""
    with _schema_changed(f"DROP TABLE {TABLE}"):
        warnings = _outbox_messages()
    assert _ids(warnings) == ["outbox_notify.W001"]
    assert TABLE in warnings[0].msg
    assert "migrate outbox_notify" in (warnings[0].hint or "")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "statement",
    [
        f"ALTER TABLE {TABLE} DISABLE TRIGGER {TRIGGER}",
        f"ALTER TABLE {TABLE} ENABLE REPLICA TRIGGER {TRIGGER}",
        f"DROP TRIGGER {TRIGGER} ON {TABLE}",
    ],
    ids=["disabled", "replica-only", "dropped"],
)
def test_w002_when_the_trigger_would_not_fire(statement: str) -> None:
    """W002 when the wake-up trigger is disabled, fires only for replicas, or is gone."""
    with _schema_changed(statement):
        warnings = _outbox_messages()
    assert _ids(warnings) == ["outbox_notify.W002"]
    assert TRIGGER in warnings[0].msg


@pytest.mark.django_db
def test_no_w002_for_a_trigger_enabled_always() -> None:
    """ENABLE ALWAYS TRIGGER fires in every session, so it is no reason to warn."""
    with _schema_changed(f"ALTER TABLE {TABLE} ENABLE ALWAYS TRIGGER {TRIGGER}"):
        assert _outbox_messages() == []


@pytest.mark.django_db
@pytest.mark.parametrize("databases", [None, ["other"]], ids=["no-list", "other-listed"])
def test_the_schema_check_queries_only_databases_django_lists(databases: list[str] | None) -> None:
    """Without the outbox alias in `databases` the schema check runs no query (Django's rule)."""
    with (
        _schema_changed(f"DROP TABLE {TABLE}"),
        CaptureQueriesContext(connections["default"]) as ctx,
    ):
        assert checks.check_schema(databases=databases) == []
    assert ctx.captured_queries == []
