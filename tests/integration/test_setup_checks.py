"""What a new project gets wrong first, each caught by `check` or at the call, naming the fix.

A mistyped or unloadable broker transport (E007), OutboxCelery without the app installed
(E008), an unreachable database (E009), a database never migrated (W004, and the error of a
`delay()` that meets it).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import transaction
from psycopg import sql as pgsql

from devtools.pgserver import free_port
from outbox_notify import OutboxCelery, checks
from outbox_notify.app import instances
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.models import OutboxMessage
from tests.relay_support import ROOT

STEP_TIMEOUT = 120  # seconds; each subprocess starts Django once


def _typo_app(broker_url: str) -> OutboxCelery:
    app = OutboxCelery("typo", set_as_current=False)
    app.conf.broker_url = broker_url
    return app


@pytest.fixture
def typo_app() -> Iterator[OutboxCelery]:
    """An OutboxCelery whose broker URL says `reddis://`, forgotten by the checks afterwards."""
    app = _typo_app("reddis://127.0.0.1:6379/15")
    yield app
    instances.discard(app)


def test_e007_names_a_mistyped_transport_and_the_one_meant(typo_app: OutboxCelery) -> None:
    """A broker URL whose scheme is no kombu transport is E007, suggesting the closest one."""
    [error] = [e for e in checks.check_broker() if e.obj == "Celery app 'typo'"]
    assert error.id == "outbox_notify.E007"
    assert error.msg == (
        "the broker URL names transport 'reddis', which kombu does not have: did you mean 'redis'?"
    )


def test_e007_names_a_transport_whose_client_library_is_missing() -> None:
    """A transport kombu has but cannot import (no pymongo here) is E007 with the import error."""
    app = _typo_app("mongodb://127.0.0.1:1/outbox")
    try:
        [error] = [e for e in checks.check_broker() if e.obj == "Celery app 'typo'"]
    finally:
        instances.discard(app)
    assert error.id == "outbox_notify.E007"
    assert "transport 'mongodb' cannot be loaded (No module named 'pymongo')" in error.msg


def test_the_suite_s_own_brokers_pass_e007() -> None:
    """Redis and the test apps' URLs load: E007 stays quiet for them."""
    assert [e for e in checks.check_broker() if e.obj == "Celery app 'tests'"] == []


@pytest.mark.django_db
def test_delay_with_a_mistyped_transport_is_one_configuration_error(
    typo_app: OutboxCelery,
) -> None:
    """`delay()` meets the transport while Celery builds the message: one clear error, no row."""
    with pytest.raises(ConfigurationError) as excinfo, transaction.atomic():
        typo_app.send_task("tests.add", (1, 2))
    assert str(excinfo.value) == (
        "Celery app 'typo': the broker URL names transport 'reddis', which kombu does not "
        "have: did you mean 'redis'?"
    )
    assert excinfo.value.__cause__ is None  # kombu's KeyError is not piled on
    assert OutboxMessage.objects.count() == 0


# -- subprocesses: `check` and `delay()` as a project runs them -------------------------------


def _python(
    argv: list[str], env: dict[str, Any], cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        check=False,
    )


@pytest.fixture
def never_migrated(pg_server_url: str, subprocess_env: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The environment of a subprocess whose database nobody migrated (dropped afterwards)."""
    name = f"outbox_never_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        yield {
            **subprocess_env,
            "OUTBOX_TEST_DATABASE_URL": pg_server_url,
            "OUTBOX_TEST_DB_NAME": name,
        }
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


def test_check_database_says_postgresql_cannot_be_reached(subprocess_env: dict[str, Any]) -> None:
    """`check --database default` with PostgreSQL down is E009 (exit 1), not "no issues"."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    env = {**subprocess_env, "OUTBOX_TEST_DATABASE_URL": url}
    result = _python(["-m", "django", "check", "--database", "default"], env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "DATABASES['default']: (outbox_notify.E009) PostgreSQL cannot be reached: " in result.stderr
    )
    assert "Connection refused" in result.stderr


def test_check_database_says_the_database_was_never_migrated(
    never_migrated: dict[str, Any],
) -> None:
    """`check --database default` on a database never migrated is W004, hint `migrate`."""
    result = _python(["-m", "django", "check", "--database", "default"], never_migrated)
    assert result.returncode == 0, result.stderr
    assert "DATABASES['default']: (outbox_notify.W004) the outbox tables do not exist" in (
        result.stderr
    )
    assert "HINT: run: python manage.py migrate\n" in result.stderr


ENQUEUE_ON_UNMIGRATED = textwrap.dedent(
    """
    import django
    django.setup()
    from django.db import DatabaseError, connection, transaction
    from tests.celery_app import add

    for in_transaction in (True, False):
        try:
            with transaction.atomic() if in_transaction else connection.cursor():
                add.delay(1, 2)
        except DatabaseError as exc:
            print(type(exc).__name__, "|", " / ".join(getattr(exc, "__notes__", ())))
    with connection.cursor() as cursor:  # the failed transaction was rolled back
        cursor.execute("SELECT 1")
    """
)


def test_delay_on_a_database_never_migrated_says_migrate(never_migrated: dict[str, Any]) -> None:
    """The database's error, raised in the caller's transaction (and in autocommit), says to
    run `python manage.py migrate`."""
    result = _python(["-c", ENQUEUE_ON_UNMIGRATED], never_migrated)
    assert result.returncode == 0, result.stderr
    # (structlog prints the library's log events on stdout too; the script's lines have a "|")
    in_atomic, in_autocommit = [line for line in result.stdout.splitlines() if " | " in line]
    fix = (
        "outbox-notify: the outbox tables do not exist on database 'default'; create them with "
        "`python manage.py migrate`"
    )
    assert in_atomic == (
        f"ProgrammingError | outbox-notify: raised while writing 1 deferred outbox rows / {fix}"
    )
    assert in_autocommit == f"ProgrammingError | {fix}"


PROJECT_WITHOUT_THE_APP = {
    # The layout docs/install.md shows: the package imports its Celery module.
    "proj/__init__.py": "from .celery import app as celery_app\n",
    "proj/celery.py": (
        "from outbox_notify import OutboxCelery\n\n"
        "app = OutboxCelery('proj')\n"
        "app.conf.broker_url = 'redis://127.0.0.1:1/0'\n"
    ),
    "proj/settings.py": (
        "from tests.settings import DATABASES, SECRET_KEY, USE_TZ\n\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes']\n"
    ),
}
SEND = textwrap.dedent(
    """
    import django
    django.setup()
    from django.db import transaction
    from proj.celery import app
    with transaction.atomic():
        app.send_task("proj.hello")
    """
)


@pytest.fixture
def project_without_the_app(tmp_path: Path, subprocess_env: dict[str, Any]) -> dict[str, Any]:
    """The environment of a project using OutboxCelery without 'outbox_notify' installed."""
    for name, text in PROJECT_WITHOUT_THE_APP.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "PYTHONPATH": f"{tmp_path}:{subprocess_env['PYTHONPATH']}",
    }


def test_check_says_outbox_notify_is_not_installed(project_without_the_app: dict[str, Any]) -> None:
    """OutboxCelery used while 'outbox_notify' is not in INSTALLED_APPS: E008, exit 1."""
    result = _python(["-m", "django", "check"], project_without_the_app)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "INSTALLED_APPS: (outbox_notify.E008) 'outbox_notify' is missing, but OutboxCelery "
        "'proj' writes tasks to the outbox" in result.stderr
    )
    assert "HINT: add 'outbox_notify' to INSTALLED_APPS, then run: python manage.py migrate" in (
        result.stderr
    )


def test_a_task_sent_without_the_app_installed_is_refused_at_the_call(
    project_without_the_app: dict[str, Any],
) -> None:
    """Without the app, `send_task` raises ConfigurationError naming INSTALLED_APPS and migrate."""
    result = _python(["-c", SEND], project_without_the_app)
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        "outbox_notify.exceptions.ConfigurationError: 'outbox_notify' is not in INSTALLED_APPS"
    ), result.stderr
    assert last.endswith("add it to INSTALLED_APPS, then run `python manage.py migrate`")
