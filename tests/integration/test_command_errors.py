"""Every outbox command: bad flag values refused where parsed, and database trouble in one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from psycopg import sql as pgsql

from devtools.pgserver import free_port
from outbox_notify.relay.runner import connection_kwargs
from tests.relay_support import ROOT

COMMANDS = {
    "outbox_listen": (),
    "outbox_sweep": (),
    "outbox_stats": (),
    "outbox_purge_dead_letter": (),
    "outbox_requeue_dead_letter": ("--all",),
    "outbox_purge_inbox": (),
    "outbox_list": (),
    "outbox_consume": ("tests.event_consumers.consumer",),
    "outbox_reindex": (),
}
NON_FINITE = ["nan", "inf", "-inf", "NaN", "Infinity"]
COMMAND_TIMEOUT = 60  # seconds; each of these commands gives up at once


def _numeric_flags() -> list[Any]:
    """(command, flag) for every flag of every outbox command that takes a number."""
    found = []
    for name in COMMANDS:
        parser = load_command_class("outbox_notify", name).create_parser("manage.py", name)
        for action in parser._actions:
            kind = getattr(action.type, "__name__", "")
            if kind in {"seconds", "whole number"} and action.option_strings:
                found.append(
                    pytest.param(
                        name, action.option_strings[0], id=f"{name}{action.option_strings[0]}"
                    )
                )
    return found


NUMERIC_FLAGS = _numeric_flags()


def _parse_error(command: str, *argv: str) -> str:
    """The usage error call_command raises for these arguments."""
    with pytest.raises(CommandError) as excinfo:
        call_command(command, *argv, *COMMANDS[command], stdout=io.StringIO())
    return str(excinfo.value)


def test_the_numeric_flags_are_found() -> None:
    """The introspection below sees every documented numeric flag (so none escapes the tests)."""
    flags = {param.values for param in NUMERIC_FLAGS}
    assert ("outbox_listen", "--backoff-time") in flags
    assert ("outbox_listen", "--max-backoff") in flags
    assert ("outbox_stats", "--fail-if-lag-above") in flags
    assert ("outbox_stats", "--top") in flags
    assert ("outbox_purge_dead_letter", "--older-than-days") in flags
    assert ("outbox_requeue_dead_letter", "--chunk-size") in flags
    assert ("outbox_listen", "--lock-wait") in flags
    assert ("outbox_purge_inbox", "--older-than-days") in flags
    assert ("outbox_consume", "--outage-cooldown") in flags
    assert ("outbox_list", "--older-than") in flags
    assert ("outbox_list", "--limit") in flags
    assert ("outbox_listen", "--metrics-port") in flags
    assert ("outbox_reindex", "--lock-wait") in flags
    # listen 11, sweep 6, stats 2, purge 2, requeue 2, purge inbox 2, list 2, consume 1,
    # reindex 3
    assert len(flags) == 31


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(("command", "flag"), NUMERIC_FLAGS)
def test_every_numeric_flag_refuses_values_that_are_not_finite(
    command: str, flag: str, value: str
) -> None:
    """nan and inf are a usage error naming the flag, for every numeric flag of every command."""
    message = _parse_error(command, f"{flag}={value}")
    assert f"argument {flag}: must be a" in message
    assert repr(value) in message


@pytest.mark.parametrize(
    ("command", "flag", "value", "expected"),
    [
        ("outbox_purge_dead_letter", "--older-than-days", "-1", "must be at least 0, not -1"),
        ("outbox_purge_dead_letter", "--chunk-size", "0", "must be at least 1, not 0"),
        ("outbox_requeue_dead_letter", "--chunk-size", "0", "must be at least 1, not 0"),
        ("outbox_purge_inbox", "--older-than-days", "-1", "must be at least 0, not -1"),
        ("outbox_purge_inbox", "--chunk-size", "0", "must be at least 1, not 0"),
        ("outbox_stats", "--top", "-1", "must be at least 0, not -1"),
        ("outbox_stats", "--fail-if-lag-above", "-5", "must be a number of seconds 0 or more"),
        ("outbox_listen", "--batch-size", "0", "must be at least 1, not 0"),
        ("outbox_listen", "--sweep-interval", "0", "must be a number of seconds above 0"),
        ("outbox_listen", "--lock-wait", "0", "must be a number of seconds above 0"),
        ("outbox_sweep", "--max-retries", "-1", "must be at least 0, not -1"),
    ],
)
def test_each_out_of_range_flag_is_named_in_its_own_message(
    command: str, flag: str, value: str, expected: str
) -> None:
    """An out-of-range value is a usage error that names the flag it was given to."""
    message = _parse_error(command, flag, value)
    assert f"argument {flag}: {expected}" in message


@pytest.mark.django_db
def test_lock_wait_longer_than_the_sweep_interval_is_refused() -> None:
    """--lock-wait past --sweep-interval would hold wake-ups back longer than the sweep."""
    with pytest.raises(CommandError, match="--lock-wait must not be longer than --sweep-interval"):
        call_command("outbox_listen", "--lock-wait", "3", "--sweep-interval", "2")


# -- --top 0 ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_top_zero_says_not_computed_in_text_and_json() -> None:
    """With --top 0, top_failing is reported as not computed (null), never as an empty list."""
    text, document = io.StringIO(), io.StringIO()
    call_command("outbox_stats", "--top", "0", stdout=text)
    call_command("outbox_stats", "--top", "0", "--format", "json", stdout=document)
    assert text.getvalue().rstrip().endswith("top_failing            not computed (--top 0)")
    assert "(none)" not in text.getvalue()
    data = json.loads(document.getvalue())
    assert data["top_failing"] is None
    assert data["exact"]["top_failing"] is None


@pytest.mark.django_db
def test_top_above_zero_still_lists_nothing_failing_as_none() -> None:
    """Computed and empty stays distinguishable from not computed: `(none)` and []."""
    text, document = io.StringIO(), io.StringIO()
    call_command("outbox_stats", stdout=text)
    call_command("outbox_stats", "--format", "json", stdout=document)
    assert text.getvalue().rstrip().endswith("top_failing:\n  (none)")
    assert json.loads(document.getvalue())["top_failing"] == []


# -- one line when PostgreSQL, the tables or a privilege is missing ---------------------------


def _run(command: str, env: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", command, *COMMANDS[command], *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def _one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 1, nothing on stdout, one CommandError line on stderr containing `words`."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("CommandError: "), result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def _server_url(server: str, user: str) -> str:
    parts = urlsplit(server)
    return f"postgresql://{user}@{parts.hostname or '127.0.0.1'}:{parts.port or 5432}/postgres"


@pytest.fixture
def empty_database(pg_server_url: str) -> Iterator[str]:
    """A database without the outbox tables, dropped after the test."""
    name = f"outbox_empty_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


@pytest.fixture
def login_role() -> Iterator[Any]:
    """A login role with no privilege on the outbox tables, and a function to grant it some."""
    role = f"outbox_ops_{uuid.uuid4().hex[:10]}"
    admin = psycopg.connect(**connection_kwargs("default"), autocommit=True)
    admin.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))

    def grant(statement: str) -> None:
        admin.execute(pgsql.SQL(statement).format(role=pgsql.Identifier(role)))

    try:
        yield role, grant
    finally:
        admin.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
        admin.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
        admin.close()


@pytest.mark.parametrize("command", COMMANDS)
def test_unreachable_postgresql_is_one_line(command: str, subprocess_env: dict[str, Any]) -> None:
    """A closed database port: exit 1 and one line, for every command."""
    env = {
        **subprocess_env,
        "OUTBOX_TEST_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
    }
    _one_line(_run(command, env), "PostgreSQL cannot be reached", "Connection refused")


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_tables_are_one_line_that_says_migrate(
    command: str, subprocess_env: dict[str, Any], empty_database: str
) -> None:
    """A database without the outbox tables: exit 1 and one line saying to migrate."""
    env = {**subprocess_env, "OUTBOX_TEST_DB_NAME": empty_database}
    _one_line(_run(command, env), "tables are missing", "python manage.py migrate outbox_notify")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_privilege_is_one_line_naming_what_is_needed(
    command: str, subprocess_env: dict[str, Any], pg_server_url: str, login_role: Any
) -> None:
    """A role without privileges on the tables: exit 1 and one line naming the privileges."""
    role, _ = login_role
    env = {**subprocess_env, "OUTBOX_TEST_DATABASE_URL": _server_url(pg_server_url, role)}
    line = _one_line(_run(command, env))
    assert "permission denied" in line or "lacks" in line
    assert "docs/security.md" in line


@pytest.mark.django_db(transaction=True)
def test_traceback_flag_shows_the_original_error(subprocess_env: dict[str, Any]) -> None:
    """--traceback (Django's convention) prints the whole chain, the driver's error included."""
    env = {
        **subprocess_env,
        "OUTBOX_TEST_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
    }
    result = _run("outbox_stats", env, "--traceback")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "OperationalError" in result.stderr
    assert "The above exception was the direct cause" in result.stderr


def _documented_operator_grant() -> list[str]:
    """The statements of the SQL block docs/operations.md shows for a monitoring role `ops`."""
    text = (ROOT / "docs" / "operations.md").read_text()
    after = text.split("test_command_errors.py runs this grant", 1)[1]
    block = after.split("```sql\n", 1)[1].split("```", 1)[0]
    code = " ".join(line.split("--", 1)[0] for line in block.splitlines())
    return [" ".join(part.split()) for part in code.split(";") if part.strip()]


@pytest.mark.django_db(transaction=True)
def test_outbox_stats_works_for_the_documented_operator_grant_not_the_relay_role(
    subprocess_env: dict[str, Any], pg_server_url: str, login_role: Any
) -> None:
    """The relay's privileges cannot read dead letters; the grant docs/operations.md shows can."""
    role, grant = login_role
    env = {**subprocess_env, "OUTBOX_TEST_DATABASE_URL": _server_url(pg_server_url, role)}
    grant("GRANT SELECT, UPDATE, DELETE ON outbox_notify_message_v1 TO {role}")
    grant("GRANT INSERT ON outbox_notify_dead_letter_v1 TO {role}")
    grant("GRANT SELECT, INSERT, UPDATE ON outbox_notify_frontier_v1 TO {role}")
    _one_line(_run("outbox_stats", env), "permission denied for table outbox_notify_dead_letter_v1")
    statements = _documented_operator_grant()
    assert len(statements) == 2, statements
    for statement in statements:
        assert statement.endswith(" TO ops"), statement
        grant(statement.removesuffix(" TO ops") + " TO {role}")
    result = _run("outbox_stats", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("queue_depth")


# -- a broker URL whose transport kombu does not have -----------------------------------------

MISTYPED_BROKER = "reddis://127.0.0.1:6379/15"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_mistyped_broker_transport_stops_every_command_in_one_line(
    command: str, subprocess_env: dict[str, Any]
) -> None:
    """`reddis://`: the system check (E007) stops each command with one line naming it."""
    env = {**subprocess_env, "OUTBOX_TEST_BROKER_URL": MISTYPED_BROKER}
    line = _one_line(_run(command, env), "(outbox_notify.E007)", "transport 'reddis'")
    assert line.endswith("did you mean 'redis'?")


@pytest.mark.django_db(transaction=True)  # the relays check their tables before the broker
@pytest.mark.parametrize("command", ["outbox_listen", "outbox_sweep"])
def test_a_mistyped_broker_transport_is_one_line_past_the_checks(
    command: str, subprocess_env: dict[str, Any]
) -> None:
    """With --skip-checks the relay commands still say it in one line, not kombu's KeyError."""
    env = {**subprocess_env, "OUTBOX_TEST_BROKER_URL": MISTYPED_BROKER}
    line = _one_line(_run(command, env, "--skip-checks"))
    assert line == (
        "CommandError: Celery app 'tests': the broker URL names transport 'reddis', which kombu "
        "does not have: did you mean 'redis'?"
    )
