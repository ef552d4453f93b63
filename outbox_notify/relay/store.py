"""The claim connection: the only place the relay claims, peeks at and finalises rows.

Driver errors are translated here, and only here, into DatabaseUnavailable (or a
ConfigurationError when the schema is missing), always `from` the original.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import psycopg
from psycopg import errors as pg_errors

from outbox_notify import sql
from outbox_notify.exceptions import ConfigurationError, DatabaseUnavailable, GaugeUnavailable
from outbox_notify.relay.config import CLAIM_APPLICATION_NAME
from outbox_notify.serialization import SCHEMA_VERSION

# TCP keepalives so a relay notices a vanished server in seconds, not hours.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
CONNECT_TIMEOUT = 10  # seconds
GAUGE_EXACT_LIMIT = 10_000  # rows: the depth gauge counts this many, then estimates


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimedRow:
    """One outbox row held by this relay's open claim."""

    id: int
    task_id: str
    task_name: str
    args: str
    kwargs: str
    options: str
    context: str
    retries: int
    schema_version: int
    created_at: dt.datetime
    # Seconds since created_at when the claim began, on the database's clock.
    age: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Retry:
    """A row to try again later; `retries` is its new count (unchanged for an outage)."""

    id: int
    retries: int
    delay: float
    error: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Dead:
    """A row to move to the dead-letter table with its reason."""

    id: int
    retries: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How a batch ends. Rows in none of the lists are released untouched."""

    published: Sequence[int] = ()
    retry: Sequence[Retry] = ()
    dead: Sequence[Dead] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Peek:
    """What a relay about to sleep needs to know about the table."""

    claimable: bool
    due: bool
    next_due_in: float | None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueueGauges:
    """The outbox's depth (exact up to GAUGE_EXACT_LIMIT rows) and its oldest row's age."""

    depth: int
    oldest_seconds: float


class ClaimWouldWait(Exception):
    """A claim made beside another open claim found the table locked (see claim())."""


class OpenClaim(Protocol):
    """The rows of one open claim, and the way to end it (rows not named are released)."""

    @property
    def rows(self) -> list[ClaimedRow]: ...

    def finish(self, outcome: Outcome) -> None: ...


class Store(Protocol):
    """What the relay loop needs from its claim side (ClaimStore; a savepoint store in tests)."""

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def claim(
        self, limit: int, *, lock_wait: float | None = None
    ) -> contextlib.AbstractContextManager[OpenClaim]: ...
    def peek(self) -> Peek: ...
    def queue_gauges(self) -> QueueGauges: ...
    def send_probe(self, payload: str) -> None: ...


def connection_kwargs(alias: str) -> dict[str, Any]:
    """psycopg.connect() keywords for a Django alias (see runner.connection_kwargs).

    Kept here for the callers that import it from the store; the store itself never calls it.
    """
    from outbox_notify.relay import runner

    return runner.connection_kwargs(alias)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Turn driver errors raised inside the block into the library's exceptions."""
    try:
        yield
    except pg_errors.UndefinedTable as exc:
        raise ConfigurationError(
            "the outbox tables are missing: run `python manage.py migrate outbox_notify`"
        ) from exc
    except psycopg.Error as exc:
        raise DatabaseUnavailable(f"{what}: {exc}") from exc


class ClaimStore:
    """Owns the claim connection and runs the relay's claim-side queries on it."""

    def __init__(self, params: dict[str, Any], *, stale_timeout: float) -> None:
        self.params = params
        self.stale_timeout_ms = str(int(stale_timeout * 1000))
        self.queries = sql.queries()
        self.conn: psycopg.Connection[Any] | None = None

    def connect(self) -> None:
        """Open the connection (closing a broken one first)."""
        self.close()
        params = {**KEEPALIVES, "connect_timeout": CONNECT_TIMEOUT, **self.params}
        params["application_name"] = CLAIM_APPLICATION_NAME
        with translated("connecting the claim connection"):
            self.conn = psycopg.connect(**params, autocommit=False)

    def close(self) -> None:
        """Close the connection; any open claim is rolled back by the server."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            raise DatabaseUnavailable("the claim connection is not open")
        return self.conn

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[Claim]:
        """Claim up to `limit` rows; the claim lasts until the block ends (commit or rollback).

        `lock_wait` (seconds), for a claim made while this relay holds another one: if the
        table stays locked that long (a lock request such as TRUNCATE or ALTER TABLE queued
        behind the other claim), give up and raise ClaimWouldWait instead of waiting for it.
        """
        conn = self._connection()
        try:
            with translated("claiming a batch"), conn.pipeline():
                conn.execute(
                    self.queries["set_claim_timeout"], {"timeout_ms": self.stale_timeout_ms}
                )
                if lock_wait is not None:
                    wait = str(max(1, int(lock_wait * 1000)))
                    conn.execute(self.queries["set_claim_lock_wait"], {"wait": wait})
                cursor = conn.execute(
                    self.queries["claim_batch"], {"limit": limit, "max_version": SCHEMA_VERSION}
                )
                if lock_wait is not None:  # the finalising statements wait as usual
                    conn.execute(self.queries["reset_claim_lock_wait"])
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.LockNotAvailable) and not conn.broken:
                self.rollback()
                raise ClaimWouldWait(str(exc.__cause__)) from exc
            raise
        with translated("claiming a batch"):
            # Columns come in ClaimedRow's field order (see claim_batch in sql/queries.sql).
            rows = [ClaimedRow(*values) for values in cursor.fetchall()]
        claim = Claim(self, rows)
        try:
            yield claim
        except BaseException:
            self.rollback()
            raise
        if not claim.finished:
            self.rollback()

    def rollback(self) -> None:
        """Release every row of the open claim untouched."""
        if self.conn is not None and not self.conn.closed:
            with contextlib.suppress(psycopg.Error):
                self.conn.rollback()

    def finish(self, outcome: Outcome) -> None:
        """Apply a batch's outcome and commit, in one pipelined round trip."""
        conn = self._connection()
        with translated("finalising a batch"), conn.pipeline():
            if outcome.retry or outcome.dead:
                conn.execute(self.queries["finalize_batch"], finalize_params(outcome))
            elif outcome.published:
                conn.execute(self.queries["delete_published"], {"ids": list(outcome.published)})
            conn.commit()

    def peek(self) -> Peek:
        """Check for claimable and held work and the next retry time, in one statement."""
        conn = self._connection()
        with translated("peeking at the outbox"):
            conn.autocommit = True  # one statement, no BEGIN/COMMIT around it
            try:
                row = conn.execute(self.queries["peek"], {"max_version": SCHEMA_VERSION}).fetchone()
            finally:
                conn.autocommit = False
        claimable, due, next_due_in = row or (False, False, None)
        return Peek(claimable=bool(claimable), due=bool(due), next_due_in=next_due_in)

    def send_probe(self, payload: str) -> None:
        """NOTIFY the LISTEN probe channel from this connection and commit (Listener.probe)."""
        conn = self._connection()
        with translated("sending the LISTEN probe"):
            conn.execute(self.queries["notify_probe"], {"payload": payload})
            conn.commit()

    def queue_gauges(self) -> QueueGauges:
        """Queue depth and the oldest row's age, from the outbox table alone, in one statement.

        A failure that leaves the connection usable (a permission, a timeout) raises
        GaugeUnavailable, so a gauge never costs the relay its connections.
        """
        conn = self._connection()
        with translated("sampling queue gauges"):
            conn.autocommit = True  # one statement, no BEGIN/COMMIT around it
            try:
                row = self._gauge_row(conn)
            finally:
                conn.autocommit = False
        counted, estimated, oldest = row or (0, None, None)
        return gauges_from(int(counted), estimated, oldest)

    def _gauge_row(self, conn: psycopg.Connection[Any]) -> Any:
        try:
            return conn.execute(self.queries["queue_gauges"], gauge_params()).fetchone()
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise  # translated into DatabaseUnavailable by the caller
            raise GaugeUnavailable(f"sampling queue gauges: {exc}") from exc


class Claim:
    """The rows of one open claim, and the way to end it."""

    def __init__(self, store: ClaimStore, rows: list[ClaimedRow]) -> None:
        self.store = store
        self.rows = rows
        self.finished = False

    def finish(self, outcome: Outcome) -> None:
        """Apply the outcome and commit; rows not named in it are released untouched."""
        self.store.finish(outcome)
        self.finished = True


def gauge_params() -> dict[str, int]:
    """Parameters of the queue_gauges query."""
    return {"limit": GAUGE_EXACT_LIMIT + 1, "window": GAUGE_EXACT_LIMIT}


def gauges_from(counted: int, estimated: float | None, oldest: float | None) -> QueueGauges:
    """The gauges from the queue_gauges query: the exact count while it stays under the cap."""
    depth = counted
    if counted > GAUGE_EXACT_LIMIT:
        depth = max(counted, round(estimated or 0.0))
    return QueueGauges(depth=depth, oldest_seconds=float(oldest or 0.0))


def finalize_params(outcome: Outcome) -> dict[str, Any]:
    """Parameters of the finalize_batch query for an outcome."""
    return {
        "published": list(outcome.published),
        "retry_ids": [r.id for r in outcome.retry],
        "retry_counts": [r.retries for r in outcome.retry],
        "retry_delays": [r.delay for r in outcome.retry],
        "retry_errors": [r.error for r in outcome.retry],
        "dead_ids": [d.id for d in outcome.dead],
        "dead_counts": [d.retries for d in outcome.dead],
        "dead_reasons": [d.reason for d in outcome.dead],
    }
