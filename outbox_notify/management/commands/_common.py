"""What every outbox command shares: flag value types, and errors as one line.

Flag values are checked where they are parsed, so a bad value is an argparse usage error
(exit status 2) whose message names the flag. Database failures and system check errors
become a one-line CommandError (exit status 1) that says what is wrong and how to fix it;
Django's own `--traceback` flag re-raises it with the original error chained, for those who
want more.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

from django.core import checks as django_checks
from django.core.management.base import BaseCommand, CommandError, SystemCheckError
from django.db import Error as DjangoDatabaseError
from django.db import connections

from outbox_notify import checks, conf
from outbox_notify.exceptions import OutboxNotifyError

UNDEFINED_TABLE = "42P01"
INSUFFICIENT_PRIVILEGE = "42501"
# SQLSTATE classes that mean "no usable session": connection exception, invalid authorization,
# unknown database, operator intervention (shutdown, terminated session).
UNREACHABLE = ("08", "28", "3D", "57")
# What the relay commands need (sql/relay_role.sql grants exactly this).
RELAY_NEEDS = (
    "SELECT, DELETE and UPDATE (retries, retry_after, last_error) on outbox_notify_message_v1 "
    "and INSERT on outbox_notify_dead_letter_v1"
)


class OutboxCommand(BaseCommand):
    """An outbox command: a system check error stops it with one line, like any other error."""

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Django's checks; the errors that stop the command folded into one CommandError."""
        try:
            super().check(*args, **kwargs)
        except SystemCheckError as exc:
            raise CommandError(_serious_checks(kwargs)) from exc


def _serious_checks(kwargs: dict[str, Any]) -> str:
    """The check messages that stopped a command, on one line (Django's own format, folded)."""
    fail_level = kwargs.get("fail_level", django_checks.ERROR)
    found = django_checks.run_checks(
        app_configs=kwargs.get("app_configs"),
        tags=kwargs.get("tags"),
        include_deployment_checks=kwargs.get("include_deployment_checks", False),
        databases=kwargs.get("databases"),
    )
    serious = sorted(
        " ".join(str(message).split())
        for message in found
        if message.is_serious(fail_level) and not message.is_silenced()
    )
    return "; ".join(serious)


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def seconds(*, allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0); nan and inf refused."""
    bound = "0 or more" if allow_zero else "above 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, not {text!r}")
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, not {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


def one_line(exc: BaseException) -> str:
    """An error's message folded onto one line (libpq's span several)."""
    return " ".join(str(exc).split())


def _primary(exc: BaseException) -> str:
    """The server's primary message (without psycopg's LINE/caret context) when there is one."""
    diag = getattr(exc.__cause__, "diag", None)
    primary = getattr(diag, "message_primary", None)
    return primary if isinstance(primary, str) and primary else one_line(exc)


def _sqlstate(exc: BaseException) -> str | None:
    # Django wraps the driver's exception and chains it as __cause__; psycopg's carries the
    # SQLSTATE. Connection failures have none.
    for error in (exc, exc.__cause__):
        state = getattr(error, "sqlstate", None)
        if isinstance(state, str):
            return state
    return None


def database_message(exc: BaseException, alias: str, needs: str) -> str:
    """The one line to print for a database error met by an outbox command."""
    state = _sqlstate(exc)
    if state == UNDEFINED_TABLE:
        return (
            f"the outbox tables are missing on database {alias!r} ({_primary(exc)}): run "
            f"`python manage.py migrate outbox_notify{_flag(alias)}`"
        )
    if state == INSUFFICIENT_PRIVILEGE:
        return (
            f"{_primary(exc)} on database {alias!r}: this command needs {needs}; grant it to "
            "the role in DATABASES or run the command as a role that has it (docs/security.md)"
        )
    if state is None or state.startswith(UNREACHABLE):
        return f"PostgreSQL cannot be reached (database {alias!r}): {one_line(exc)}"
    return f"database error on {alias!r}: {_primary(exc)}"


def _flag(alias: str) -> str:
    return "" if alias == "default" else f" --database {alias}"


@contextlib.contextmanager
def reported(needs: str) -> Iterator[None]:
    """Turn outbox and database errors inside the block into one-line CommandErrors.

    `needs` says which privileges the command needs, for the permission-denied message.
    """
    try:
        yield
    except OutboxNotifyError as exc:
        raise CommandError(one_line(exc)) from exc
    except DjangoDatabaseError as exc:
        raise CommandError(database_message(exc, _alias(), needs)) from exc


def _alias() -> str:
    try:
        return conf.database_alias()
    except OutboxNotifyError:
        return "?"


def require_relay_privileges() -> None:
    """Stop a relay command at start, in one line, when its tables or privileges are missing.

    The relay would otherwise meet a missing privilege at its first claim and, taking it for
    a database outage, reconnect forever.
    """
    alias = conf.database_alias()
    connection = connections[alias]
    with reported(RELAY_NEEDS):
        try:
            with connection.cursor() as cursor:
                cursor.execute(checks.queries()["relay_privileges"])
                rows = cursor.fetchall()
        finally:
            connection.close()  # the relay opens its own connections
    if any(held is None for _, _, held in rows):
        raise CommandError(
            f"the outbox tables are missing on database {alias!r}: run "
            f"`python manage.py migrate outbox_notify{_flag(alias)}`"
        )
    missing = [f"{privilege} on {table}" for table, privilege, held in rows if not held]
    if missing:
        raise CommandError(
            f"the database role of {alias!r} lacks {', '.join(missing)}, which the relay "
            "needs (sql/relay_role.sql grants them; see docs/security.md)"
        )


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """Log lines printed while the block runs go to stderr; stdout keeps the command's report.

    structlog's default logger prints to whatever `sys.stdout` is when an event is logged,
    which is the command's stdout; the command writes its report through `self.stdout`,
    bound before the block. (A logging setup that names its stream itself is left alone.)
    """
    with contextlib.redirect_stdout(sys.stderr):
        yield
