"""The system checks: each id fires for its cause, names what is wrong, and stays quiet otherwise."""

from __future__ import annotations

import contextlib
import importlib
import io
import shlex
import sys
import threading
from collections.abc import Iterator
from typing import Any

import celery
import psycopg
import pytest
from celery import _state as celery_state_module
from django.conf import settings
from django.core import checks as django_checks
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from outbox_notify import checks, conf, wiring
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.tasks import purge_dead_letters
from tests import celery_app, plain_celery

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
    assert str(errors[0]).count("OUTBOX_NOTIFY_CELERY_APP") == 1


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
    _invalid("OUTBOX_NOTIFY_STATSD_PORT", 8125.5, "fraction"),
    _invalid("OUTBOX_NOTIFY_STATSD_PORT", 70000, "out-of-range"),
    _invalid("OUTBOX_NOTIFY_STATSD_TAGS", "env:prod", "a-string"),
    _invalid("OUTBOX_NOTIFY_STATSD_HOST", 127, "not-a-string"),
    _invalid("OUTBOX_NOTIFY_METRICS_PORT", "9108", "a-string"),
    _invalid("OUTBOX_NOTIFY_METRICS_PORT", 70000, "out-of-range"),
    _invalid("OUTBOX_NOTIFY_METRICS_ADDRESS", "", "empty"),
    _invalid("OUTBOX_NOTIFY_MAX_MESSAGE_BYTES", 0, "zero"),
    _invalid("OUTBOX_NOTIFY_MAX_MESSAGE_BYTES", "10MB", "a-string"),
]


@pytest.mark.parametrize(("setting", "overrides"), INVALID_SETTINGS)
def test_e004_names_each_invalid_setting(setting: str, overrides: dict[str, Any]) -> None:
    """One E004 per invalid OUTBOX_NOTIFY_* value, under that setting's name, printed once."""
    with override_settings(**overrides):
        errors = checks.check_settings()
    assert _ids(errors) == ["outbox_notify.E004"]
    assert errors[0].obj == setting
    assert str(errors[0]).count("OUTBOX_NOTIFY_") == 1, str(errors[0])
    assert str(errors[0]).startswith(f"{setting}: (outbox_notify.E004) ")


def test_e004_reports_every_invalid_setting_at_once() -> None:
    """Several invalid settings give one E004 each in one run, StatsD ones even without a host."""
    invalid = {
        "OUTBOX_NOTIFY_DATABASE": "nope",
        "OUTBOX_NOTIFY_EXCLUDE_TASKS": "tests.add",
        "OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS": -1,
        "OUTBOX_NOTIFY_STATSD_PORT": "eighty",
        "OUTBOX_NOTIFY_STATSD_TAGS": 5,
        "OUTBOX_NOTIFY_MAX_MESSAGE_BYTES": -5,
    }
    with override_settings(**invalid):
        errors = checks.check_settings()
    assert _ids(errors) == ["outbox_notify.E004"] * len(invalid)
    assert sorted(str(error.obj) for error in errors) == sorted(invalid)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("setting", sorted(conf.KNOWN_SETTINGS))
def test_every_setting_refuses_values_that_are_not_finite(setting: str, value: float) -> None:
    """nan and +/-inf are an E004 for every setting outbox-notify reads."""
    with override_settings(**{setting: value}):
        errors = checks.check_settings()
    assert [(e.id, e.obj) for e in errors] == [("outbox_notify.E004", setting)]


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("OUTBOX_NOTIFY_DATABSE", "OUTBOX_NOTIFY_DATABASE"),
        ("OUTBOX_NOTIFY_STATSD_HOTS", "OUTBOX_NOTIFY_STATSD_HOST"),
        ("OUTBOX_NOTIFY_DEADLETTER_RETENTION", "OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS"),
        ("OUTBOX_NOTIFY_INBOX_RETENTION", "OUTBOX_NOTIFY_INBOX_RETENTION_DAYS"),
    ],
)
def test_w003_names_an_unknown_setting_and_the_closest_known_one(typo: str, meant: str) -> None:
    """A misspelt OUTBOX_NOTIFY_* setting is a W003 suggesting the setting it most resembles."""
    with override_settings(**{typo: "x"}):
        warnings = checks.check_settings()
    assert [(w.id, w.obj) for w in warnings] == [("outbox_notify.W003", typo)]
    assert f"did you mean {meant}?" in warnings[0].msg
    assert warnings[0].hint == f"rename it to {meant}"


def test_w003_without_a_close_name_suggests_nothing() -> None:
    """An unknown setting that resembles no known one is still reported, without a guess."""
    with override_settings(OUTBOX_NOTIFY_ZZZ=1):
        [warning] = checks.check_settings()
    assert (warning.id, warning.obj) == ("outbox_notify.W003", "OUTBOX_NOTIFY_ZZZ")
    assert "did you mean" not in warning.msg


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


# -- the Celery app tasks go through (E005, E006, and the app config's wiring) ------------------


@pytest.fixture
def celery_state() -> Iterator[None]:
    """Celery's current and default app as they are now, restored after the test."""
    tls = getattr(celery_state_module, "_tls")  # noqa: B009
    saved = (tls.current_app, celery_state_module.default_app)
    try:
        yield
    finally:
        tls.current_app, celery_state_module.default_app = saved


def _in_another_thread(func: Any) -> Any:
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(func()))
    thread.start()
    thread.join()
    return box[0]


def test_the_app_config_makes_the_configured_app_current_and_default() -> None:
    """After start-up the configured OutboxCelery is the default app, so every thread uses it."""
    # Only the default is pinned here: a test that creates another OutboxCelery makes that one
    # current in this thread, which is fine (it writes to the outbox too).
    current, default = wiring.current_and_default()
    assert default is celery_app.app
    assert wiring.is_outbox_app(current)
    assert _in_another_thread(celery.current_app._get_current_object) is celery_app.app


@pytest.mark.usefixtures("celery_state")
def test_install_makes_the_configured_app_current_over_a_plain_one() -> None:
    """ready()'s wiring replaces a plain current and default app with the configured one."""
    plain_celery.app.set_default()
    plain_celery.app.set_current()
    wiring.install()
    assert wiring.current_and_default() == (celery_app.app, celery_app.app)
    assert checks.check_task_app() == []


def test_e005_when_the_configured_app_is_a_plain_celery() -> None:
    """E005, with the OutboxCelery hint, when OUTBOX_NOTIFY_CELERY_APP names a celery.Celery."""
    with override_settings(OUTBOX_NOTIFY_CELERY_APP="tests.plain_celery.app"):
        errors = checks.check_settings()
    assert [(e.id, e.obj) for e in errors] == [("outbox_notify.E005", "OUTBOX_NOTIFY_CELERY_APP")]
    assert "celery.app.base.Celery" in errors[0].msg
    assert "OutboxCelery('proj')" in (errors[0].hint or "")


@pytest.mark.usefixtures("celery_state")
@pytest.mark.parametrize("where", ["current", "default"])
def test_e006_when_a_plain_app_would_send_the_tasks(where: str) -> None:
    """E006 when this thread's current app, or the default app, is not an OutboxCelery."""
    (plain_celery.app.set_current if where == "current" else plain_celery.app.set_default)()
    errors = checks.check_task_app()
    assert _ids(errors) == ["outbox_notify.E006"]
    assert "plain" in errors[0].msg
    assert "set_as_current=False" in (errors[0].hint or "")


@pytest.mark.usefixtures("celery_state")
def test_e006_hint_names_the_setting_when_it_is_unset_and_no_app_exists() -> None:
    """With no app at all and the setting unset, E006 says to set OUTBOX_NOTIFY_CELERY_APP."""
    celery_state_module.default_app = None
    getattr(celery_state_module, "_tls").current_app = None  # noqa: B009
    with override_settings(OUTBOX_NOTIFY_CELERY_APP=None):
        errors = checks.check_task_app()
    assert _ids(errors) == ["outbox_notify.E006"]
    assert "Celery's fallback app" in errors[0].msg
    assert "OUTBOX_NOTIFY_CELERY_APP = 'proj.celery.app'" in (errors[0].hint or "")


@pytest.mark.usefixtures("celery_state")
@pytest.mark.parametrize(
    "path", ["tests.plain_celery.app", "tests.no_such_module.app"], ids=["plain", "missing"]
)
def test_an_unusable_configured_app_makes_tasks_fail_at_the_call(path: str) -> None:
    """With a plain or unimportable configured app, a shared task raises instead of bypassing."""
    plain_celery.app.set_default()
    getattr(celery_state_module, "_tls").current_app = None  # noqa: B009
    with override_settings(OUTBOX_NOTIFY_CELERY_APP=path):
        wiring.install()
    current, default = wiring.current_and_default()
    assert isinstance(default, wiring.RefusingCelery)
    assert current is default
    with pytest.raises(ConfigurationError, match=r"task 'outbox_notify.purge_dead_letters'"):
        purge_dead_letters.delay()
    assert checks.check_task_app() == []  # E003/E005 explain it; no pile-up


@pytest.mark.usefixtures("celery_state")
def test_an_unimportable_path_leaves_a_working_outbox_app_in_place() -> None:
    """If an OutboxCelery is already current and default, a bad path does not replace it."""
    with override_settings(OUTBOX_NOTIFY_CELERY_APP="tests.no_such_module.app"):
        wiring.install()
    assert wiring.current_and_default() == (celery_app.app, celery_app.app)


# -- schema hints that work (W001, W002) ------------------------------------------------------


def _run_hint_commands(hint: str) -> None:
    """Run the `python manage.py ...` commands a hint gives, in order."""
    for command in hint.split("run: ", 1)[1].split(" && "):
        argv = shlex.split(command)
        assert argv[:2] == ["python", "manage.py"], command
        call_command(*argv[2:], verbosity=0)


NEVER_MIGRATED = (
    "DROP TABLE outbox_notify_message_v1, outbox_notify_dead_letter_v1, outbox_notify_inbox_v1;"
    " DROP FUNCTION outbox_notify_wake_v1();"
    " DELETE FROM django_migrations WHERE app = 'outbox_notify'"
)


@pytest.mark.django_db
def test_w004_not_w001_before_the_outbox_is_migrated() -> None:
    """A database never migrated is a W004 whose hint is `migrate`, not W001's repair commands."""
    with _schema_changed(NEVER_MIGRATED):
        [warning] = _outbox_messages()
    assert warning.id == "outbox_notify.W004"
    assert warning.obj == "DATABASES['default']"
    assert "never migrated" in warning.msg
    assert warning.hint == "run: python manage.py migrate"


@pytest.mark.django_db
def test_migrate_itself_does_not_warn_about_the_tables_it_creates() -> None:
    """`migrate` runs the database checks first; W004 stays quiet there, and the hint works."""
    stderr = io.StringIO()
    with _schema_changed(NEVER_MIGRATED):
        call_command("migrate", "outbox_notify", verbosity=0, stderr=stderr, skip_checks=False)
        assert _outbox_messages() == []
    assert "W004" not in stderr.getvalue()


@pytest.mark.django_db
def test_w001_hint_re_migrates_a_schema_dropped_behind_djangos_back() -> None:
    """Recorded as migrated but gone: the hint's `zero --fake` and `migrate` bring it back."""
    with _schema_changed(
        f"DROP TABLE {TABLE}, outbox_notify_dead_letter_v1; DROP FUNCTION {TRIGGER}()"
    ):
        [warning] = _outbox_messages()
        assert warning.id == "outbox_notify.W001"
        assert "zero --fake" in (warning.hint or "")
        _run_hint_commands(warning.hint or "")
        assert _outbox_messages() == []


@pytest.mark.django_db
def test_w001_hint_keeps_the_inbox_when_only_the_inbox_is_left() -> None:
    """Only the OnceTask keys left: the hint rebuilds the rest around them and keeps every key."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox_notify_inbox_v1 (scope, key, task_id, task_name)"
            " VALUES ('tests.once', 'kept', 't-1', 'tests.once')"
        )
    with _schema_changed(
        f"DROP TABLE {TABLE}, outbox_notify_dead_letter_v1; DROP FUNCTION {TRIGGER}()"
    ):
        [warning] = _outbox_messages()
        assert "only the inbox" in (warning.hint or "")
        _run_hint_commands(warning.hint or "")
        assert _outbox_messages() == []
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT key FROM outbox_notify_inbox_v1")
            assert cursor.fetchall() == [("kept",)]


@pytest.mark.django_db
def test_w001_hint_when_every_table_is_gone_fakes_zero_and_migrates() -> None:
    """Nothing of the schema left, the inbox included: `zero --fake` and `migrate`."""
    with _schema_changed(
        f"DROP TABLE {TABLE}, outbox_notify_dead_letter_v1, outbox_notify_inbox_v1;"
        f" DROP FUNCTION {TRIGGER}()"
    ):
        [warning] = _outbox_messages()
        assert "the schema is gone" in (warning.hint or "")
        _run_hint_commands(warning.hint or "")
        assert _outbox_messages() == []


@pytest.mark.django_db
def test_w001_hint_for_a_partly_dropped_schema_migrates_down_for_real() -> None:
    """With the dead letters still there, the hint migrates to zero (not --fake) and back."""
    with _schema_changed(f"DROP TABLE {TABLE}"):
        [warning] = _outbox_messages()
        assert "zero --fake" not in (warning.hint or "")
        assert "save the dead letters" in (warning.hint or "")
        _run_hint_commands(warning.hint or "")
        assert _outbox_messages() == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    "statement",
    [
        f"ALTER TABLE {TABLE} DISABLE TRIGGER {TRIGGER}",
        f"ALTER TABLE {TABLE} ENABLE REPLICA TRIGGER {TRIGGER}",
        f"DROP TRIGGER {TRIGGER} ON {TABLE}",
        f"DROP TRIGGER {TRIGGER} ON {TABLE}; DROP FUNCTION {TRIGGER}()",
    ],
    ids=["disabled", "replica-only", "dropped", "function-dropped-too"],
)
def test_w002_hint_is_sql_that_makes_the_trigger_fire_again(statement: str) -> None:
    """The W002 hint's SQL, run as given, leaves a trigger that fires, so W002 goes away."""
    with _schema_changed(statement):
        [warning] = _outbox_messages()
        assert warning.id == "outbox_notify.W002"
        fix = (warning.hint or "").split("run: ", 1)[1]
        with connections["default"].cursor() as cursor:
            cursor.execute(fix)
        assert _outbox_messages() == []


@pytest.fixture
def module_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A directory on sys.path for throwaway Celery modules (forgotten again after the test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("celery_module_")]:
        del sys.modules[name]


@pytest.mark.usefixtures("celery_state")
def test_a_celery_module_that_sets_django_up_itself_is_left_to_finish(module_dir: Any) -> None:
    """Wiring called from inside the Celery module's own import (its django.setup()) waits for it."""
    (module_dir / "celery_module_self.py").write_text(
        "from outbox_notify import wiring\n"
        "wiring.install()  # what its django.setup() would reach\n"
        "from tests.celery_app import app\n"
    )
    with override_settings(OUTBOX_NOTIFY_CELERY_APP="celery_module_self.app"):
        importlib.import_module("celery_module_self")
    assert not isinstance(wiring.current_and_default()[1], wiring.RefusingCelery)


@pytest.mark.usefixtures("celery_state")
def test_a_celery_module_that_cannot_be_imported_during_setup_says_why(module_dir: Any) -> None:
    """A module that fails while Django starts (django.setup() inside it) gets a clear error."""
    (module_dir / "celery_module_reentrant.py").write_text(
        'raise RuntimeError("populate() isn\'t reentrant")\n'
    )
    with (
        override_settings(OUTBOX_NOTIFY_CELERY_APP="celery_module_reentrant.app"),
        pytest.raises(ConfigurationError, match=r"must not call django\.setup\(\) itself"),
    ):
        wiring.install()
