"""Rows written just before the caller's next statement or its COMMIT, not at the call.

Inside `transaction.atomic()` a `delay()` keeps its (already validated) row in memory on
the Django connection of the outbox alias, and the rows are written:

- before any other statement runs on that connection (an execute wrapper, so statements
  reach PostgreSQL in the order the caller issued them, and a query of the outbox table in
  the same transaction sees its rows), except `RELEASE SAVEPOINT`, which changes nothing
  for them;
- before COMMIT (the connection's `_commit`), so they commit with the transaction or the
  commit fails;
- when MAX_PENDING rows wait.

A rollback (`_rollback`) forgets them, as the database would. Many rows go in one COPY, one
in one INSERT: a transaction that enqueues N tasks pays one round trip for all of them, and
a call pays none.

What can still fail when the rows are written is the database itself (connection lost,
statement or lock timeout, disk full, a missing table or privilege): never the row, which is
checked at the call (JSON, NUL characters, size, and ASCII id and name, which every server
encoding stores). Such a failure is raised by the statement or the COMMIT that wrote the
rows, with a note saying so, and the transaction rolls back as for any failed statement.

Rows are written at the call instead when deferring could change what the caller sees:
outside `atomic()` (autocommit), in a transaction that already failed, while Django logs
queries (DEBUG, `assertNumQueries`), and for a non-ASCII task id or name.

The hooks are private to Django, so rows wait only under the Django releases the suite ran on
(outbox_notify/_compat.py), and only once a probe (`hook_problem`, once per process and connection
class, no I/O; run at start-up by the app config) has seen Django's own `atomic()` commit,
roll back and close through them. Otherwise every row is written at the call. The first
enqueue of a process logs which path runs and why: `outbox.deferred_rows_available` (info)
or `outbox.deferred_rows_unavailable` (warning).

A psycopg connection is the rows' only while its Django connection holds it: closing the
Django connection ends them (a pool may lend the psycopg connection to another one next).

User code that ends the transaction on the psycopg connection itself
(`connection.connection.commit()` / `.rollback()`) is seen too: the psycopg connection's
`commit` writes the waiting rows first, so they commit with it, and its `rollback` forgets
them, as the database does.

A bulk block's full batches are written by a COPY that runs on a writer thread while the
caller builds the next batch (`start`): PostgreSQL checks and stores one batch while Python
makes the next. The COPY holds the psycopg connection's lock from before `start` returns
until it ends, so nothing else reaches the connection in between, and the hooks above wait
for it (`wait`) before the caller's next statement, COMMIT or rollback, raising what it
raised there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import structlog.stdlib
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionDoesNotExist
from psycopg import pq

from outbox_notify import _compat, conf
from outbox_notify.exceptions import OutboxNotifyError
from outbox_notify.serialization import OutboxRow

log = structlog.get_logger("outbox_notify")

MAX_PENDING = 5_000  # rows kept in memory before they are written anyway
UNDEFINED_TABLE = "42P01"  # SQLSTATE of a missing relation: a database never migrated
_STATE = "_outbox_notify_deferred"
_INERROR = pq.TransactionStatus.INERROR
_RELEASE = "RELEASE SAVEPOINT "
_ROLLBACK_TO = "ROLLBACK TO SAVEPOINT "

Writer = Callable[[BaseDatabaseWrapper, Sequence[OutboxRow]], None]
# Runs on the writer thread; calls its argument once it holds the connection (COPY started).
Work = Callable[[Callable[[], None]], None]


class Background:
    """One write running on a thread of its own; `join` hands back what it raised."""

    def __init__(self, count: int, work: Work) -> None:
        self.count = count
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(work,), name="outbox-notify-copy", daemon=True
        )
        self._thread.start()
        # Until the work holds the connection, a statement of the caller could overtake it.
        self._started.wait()

    def _run(self, work: Work) -> None:
        try:
            work(self._started.set)
        except BaseException as exc:  # handed to the caller's thread by join()
            self.error = exc
        finally:
            self._started.set()

    def join(self) -> BaseException | None:
        """Wait for the write to end; what it raised, if anything."""
        self._thread.join()
        return self.error


class Deferred:
    """The rows one Django connection owes the outbox table, and the hooks that write them."""

    def __init__(self, connection: BaseDatabaseWrapper, writer: Writer) -> None:
        self.connection = connection
        self.writer = writer
        self.rows: list[OutboxRow] = []
        self.raw: Any = None  # the psycopg connection the rows belong to
        self.writing: Background | None = None  # a COPY running on its own thread
        self.original_commit: Callable[[], Any] = connection._commit  # type: ignore[attr-defined]
        self.original_rollback: Callable[[], Any] = connection._rollback  # type: ignore[attr-defined]
        self.original_close: Callable[[], Any] = connection._close  # type: ignore[attr-defined]

    def add(self, row: OutboxRow) -> bool:
        """Keep `row` for later; False when it must be written now (see the module docstring)."""
        if self.writing is not None:
            self.wait()
        connection = self.connection
        raw = connection.connection
        if (
            not available(connection)  # first: says which path runs, at the first enqueue
            or raw is None
            or not connection.in_atomic_block
            or connection.needs_rollback
            or connection.closed_in_transaction
            or connection.queries_logged
            or raw.closed
            or raw.pgconn.transaction_status == _INERROR
            or not (row.task_id.isascii() and row.task_name.isascii())
        ):
            return False
        connection.validate_thread_sharing()
        if raw is not self.raw:
            self.rows = []  # rows of a connection closed since: lost with its transaction
            self.adopt(raw)
        self.rows.append(row)
        if len(self.rows) >= MAX_PENDING:
            self.flush()
        return True

    def adopt(self, raw: Any) -> None:
        """Make `raw` the psycopg connection the rows belong to, and see its own commits.

        Code that commits or rolls back on the psycopg connection itself bypasses Django: its
        `commit` writes the waiting rows first (they commit with it), its `rollback` forgets
        them (they roll back with it), instead of leaving them for a later transaction.
        """
        self.raw = raw
        hooked = getattr(raw, _STATE, None) is not None
        # The Deferred the psycopg connection's rows belong to now (a pooled connection passes
        # from one Django connection to another; its hooks are installed once).
        setattr(raw, _STATE, self)
        if hooked:
            return
        commit, rollback = raw.commit, raw.rollback

        def raw_commit() -> None:
            owner: Deferred | None = getattr(raw, _STATE, None)
            if owner is not None and owner.holds(raw):
                owner.flush()
            commit()

        def raw_rollback() -> None:
            owner: Deferred | None = getattr(raw, _STATE, None)
            if owner is not None and owner.holds(raw):
                owner.discard()
                owner.abandon()
            rollback()

        raw.commit, raw.rollback = raw_commit, raw_rollback

    def holds(self, raw: Any) -> bool:
        """Whether `raw` is the psycopg connection of these rows and its Django connection still
        holds it. A pool (Django's `OPTIONS["pool"]`) lends a returned connection to another
        Django connection, maybe in another thread: its commits and rollbacks are not ours."""
        return raw is not None and self.raw is raw and self.connection.connection is raw

    def flush(self) -> None:
        """Write the rows that wait, now (one round trip), after a COPY still running."""
        if self.writing is not None:
            self.wait()
        rows, self.rows = self.rows, []
        if not rows:
            return
        raw = self.connection.connection
        if raw is not self.raw or raw is None or raw.closed:
            return  # the connection, and its transaction, are gone: so are the rows
        if raw.pgconn.transaction_status == _INERROR:
            return  # the transaction failed; it can only roll back, taking the rows along
        try:
            self.writer(self.connection, rows)
        except Exception as exc:
            self._failed(exc, len(rows))
            raise

    def start(self, count: int, work: Work) -> None:
        """Run `work` (a COPY of `count` rows) on a thread; return once it holds the connection."""
        self.flush()
        if self.connection.connection is not self.raw:
            self.rows = []
            self.adopt(self.connection.connection)
        self.writing = Background(count, work)

    def wait(self) -> None:
        """Wait for the COPY running on its thread; raise here what it raised there."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        error = writing.join()
        if error is None:
            return
        if not isinstance(error, Exception):
            raise error
        try:
            with self.connection.wrap_database_errors:  # psycopg's error as Django's
                raise error
        except Exception as translated:
            self._failed(translated, writing.count)
            raise

    def abandon(self) -> None:
        """Wait for the COPY running on its thread, which a rollback is about to undo."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        error = writing.join()
        if error is not None:  # undone with the rest; logged, as nobody else will see it
            self._failed(error, writing.count)

    def _failed(self, exc: BaseException, count: int) -> None:
        exc.add_note(f"outbox-notify: raised while writing {count} deferred outbox rows")
        explain(exc, self.connection.alias)
        log.error(
            "outbox.deferred_write_failed",
            count=count,
            database=self.connection.alias,
            error=f"{type(exc).__name__}: {exc}",
        )

    def discard(self) -> None:
        """Forget the rows that wait (their transaction rolled back)."""
        self.rows = []

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        """The execute wrapper: write the waiting rows before the caller's statement."""
        if self.writing is not None:
            if isinstance(sql, str) and sql.startswith(_ROLLBACK_TO):
                # The savepoint is older than the COPY (creating it waited for the COPY before
                # it), so the rollback undoes the COPY whatever became of it.
                self.abandon()
            else:
                self.wait()
        if self.rows and not (isinstance(sql, str) and sql.startswith(_RELEASE)):
            self.flush()
        return execute(sql, params, many, context)

    def commit(self) -> Any:
        """The connection's `_commit`: the rows first, then COMMIT."""
        self.flush()
        return self.original_commit()

    def rollback(self) -> Any:
        """The connection's `_rollback`: the rows are forgotten with the transaction."""
        self.discard()
        self.abandon()
        return self.original_rollback()

    def close(self) -> Any:
        """The connection's `_close`: a COPY still running ends first (lost with the session).

        The waiting rows end with the transaction the close ends, and the psycopg connection
        stops being theirs before it is closed or handed back to a pool (whose rollback of it,
        and the next borrower's commits, then leave these rows alone).
        """
        self.abandon()
        self.discard()
        self.raw = None
        return self.original_close()


def explain(exc: BaseException, alias: str) -> None:
    """Add the fix to the database's error when the outbox table is missing (not migrated)."""
    # Django's error chains the driver's, which carries the SQLSTATE.
    if UNDEFINED_TABLE in (
        getattr(exc, "sqlstate", None),
        getattr(exc.__cause__, "sqlstate", None),
    ):
        flag = "" if alias == "default" else f" --database {alias}"
        exc.add_note(
            f"outbox-notify: the outbox tables do not exist on database {alias!r}; create "
            f"them with `python manage.py migrate{flag}`"
        )


def for_connection(connection: BaseDatabaseWrapper, writer: Writer) -> Deferred:
    """The Deferred of `connection`, hooked in on first use (once per connection object)."""
    state: Deferred | None = connection.__dict__.get(_STATE)
    if state is None:
        state = Deferred(connection, writer)
        # First in the list: Django's execute_wrapper() context manager pops the last one.
        connection.execute_wrappers.insert(0, state)
        connection._commit = state.commit  # type: ignore[attr-defined]
        connection._rollback = state.rollback  # type: ignore[attr-defined]
        connection._close = state.close  # type: ignore[attr-defined]
        connection.__dict__[_STATE] = state
    return state


def pending(connection: BaseDatabaseWrapper) -> Deferred | None:
    """The Deferred of `connection` if it has one (nothing is hooked in otherwise)."""
    state: Deferred | None = connection.__dict__.get(_STATE)
    return state


def flush(connection: BaseDatabaseWrapper) -> None:
    """Write what `connection` owes the outbox table now (before writing past it)."""
    state = pending(connection)
    if state is not None and (state.rows or state.writing is not None):
        state.flush()


def is_ours(wrapper: Any) -> bool:
    """Whether an execute wrapper is the outbox's (which observes nothing)."""
    return isinstance(wrapper, Deferred)


# --- whether the hooks can be trusted ---------------------------------------------------------

_PROBE_ALIAS = "outbox_notify_probe"  # registered for this thread only, during the probe
_DEFERRED = ""  # in _announced once outbox.deferred_rows_available was logged
_problems: dict[type, str | None] = {}
_announced: set[str] = set()


class _ProbeRaw:
    """Stands in for the psycopg connection in the probe: answers, records nothing, no I/O."""

    closed = False
    autocommit = True

    def commit(self) -> None:
        """Nothing to commit."""

    def rollback(self) -> None:
        """Nothing to roll back."""

    def close(self) -> None:
        """Nothing to close."""


class _ProbeRollback(Exception):
    """Raised inside the probe's second atomic() block to make Django roll it back."""


def _probe(connection: BaseDatabaseWrapper) -> str | None:
    """Run Django's own atomic() commit, rollback and close on a wrapper of this class.

    The wrapper is new, never connected (a stand-in plays psycopg's part), and registered
    under a private alias for this thread only while the probe runs.
    """
    wrapper = type(connection)(connection.settings_dict, alias=_PROBE_ALIAS)
    wrapper.connection = _ProbeRaw()
    wrapper.autocommit = True
    wrapper.health_check_done = True  # type: ignore[attr-defined]  # no SELECT 1 on the stand-in
    state = for_connection(wrapper, _never_writes)
    seen: list[str] = []
    state.original_commit = lambda: seen.append("commit")
    state.original_rollback = lambda: seen.append("rollback")
    state.original_close = lambda: seen.append("close")
    connections[_PROBE_ALIAS] = wrapper
    try:
        with transaction.atomic(using=_PROBE_ALIAS):
            pass
        try:
            with transaction.atomic(using=_PROBE_ALIAS):
                raise _ProbeRollback
        except _ProbeRollback:
            pass
        wrapper.close()
    finally:
        del connections[_PROBE_ALIAS]
    if seen != ["commit", "rollback", "close"]:
        return (
            "Django's atomic() did not go through the connection's _commit, _rollback and "
            f"_close (the probe saw {seen or 'none of them'})"
        )
    return None


def _never_writes(connection: BaseDatabaseWrapper, rows: Sequence[OutboxRow]) -> None:
    raise AssertionError("the probe never writes rows")  # pragma: no cover


def probe_at_start_up() -> None:
    """Probe the outbox database's connection class now, at start-up (AppConfig.ready).

    No I/O: the probe's connection never connects. Nothing is logged here (a log line at
    start-up would print on the stdout of every management command while structlog is left
    unconfigured): the path is logged at the first enqueue (`available`).
    """
    try:
        connection = connections[conf.database_alias()]
    except (OutboxNotifyError, ConnectionDoesNotExist, ImproperlyConfigured):
        return  # the system checks report the setting; the first enqueue probes again
    hook_problem(connection)


def hook_problem(connection: BaseDatabaseWrapper) -> str | None:
    """Why rows may not wait on this connection (None: they may); probed once per class."""
    cls = type(connection)
    if cls not in _problems:
        problem = _compat.django_problem()
        if problem is None:
            try:
                problem = _probe(connection)
            except Exception as exc:  # whatever broke, the hooks cannot be trusted
                problem = f"the probe of Django's commit path raised {type(exc).__name__}: {exc}"
        _problems[cls] = problem
    return _problems[cls]


def available(connection: BaseDatabaseWrapper) -> bool:
    """Whether rows may wait on this connection; the first time, logs which path runs and why
    (once per process and reason)."""
    problem = hook_problem(connection)
    if problem is None:
        if _DEFERRED not in _announced:
            _announced.add(_DEFERRED)
            _announcer().info(
                "outbox.deferred_rows_available",
                reason=_why_deferred(),
                path="deferred",
                database=connection.alias,
            )
        return True
    if problem not in _announced:
        _announced.add(problem)
        _announcer().warning(
            "outbox.deferred_rows_unavailable",
            reason=problem,
            path="at_call",
            database=connection.alias,
        )
    return False


def _announcer() -> Any:
    """Where the path is logged: through the project's structlog configuration if it has one;
    else to the standard `logging` logger `outbox_notify`. structlog left unconfigured would
    print on the stdout of the user's own process (a shell, a script, a web server) at its
    first enqueue; an unconfigured `logging` shows only the warning (on stderr)."""
    if structlog.is_configured():
        return log
    return structlog.wrap_logger(
        logging.getLogger("outbox_notify"),
        processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def _why_deferred() -> str:
    (low_major, low_minor), (high_major, high_minor) = _compat.DJANGO_TESTED
    return (
        f"Django {_compat.version_of('django')} is in the tested {low_major}.{low_minor}-"
        f"{high_major}.{high_minor}.x and the probe saw its atomic() commit, roll back "
        "and close through the hooks"
    )


def forget_probes() -> None:
    """Probe again at the next use (for tests that change what Django does)."""
    _problems.clear()
    _announced.clear()
    _compat.django_problem.cache_clear()
