"""The claim connection: the only place the relay claims, peeks at and finalises rows.

Driver errors are translated here, and only here, into DatabaseUnavailable (or a
ConfigurationError when the schema is missing), always `from` the original.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, LiteralString, Protocol

import psycopg
import structlog
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.types.json import Json

from outbox_notify import sql
from outbox_notify.exceptions import ConfigurationError, DatabaseUnavailable, GaugeUnavailable
from outbox_notify.relay.config import CLAIM_APPLICATION_NAME
from outbox_notify.relay.frontier import Frontier, Seen, Taken
from outbox_notify.serialization import SCHEMA_VERSION

log = structlog.get_logger("outbox_notify")

# TCP keepalives so a relay notices a vanished server in seconds, not hours.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
CONNECT_TIMEOUT = 10  # seconds
# Seconds between saves of the frontier (outbox_notify_frontier_v1), each made inside a claim
# that happens anyway: a relay or sweep starting later reads from there instead of from the
# start of every index, which a long snapshot may have filled with published rows.
FRONTIER_SAVE_INTERVAL = 5.0
RESTAMP_BATCH = 5_000  # rows copied in from another cluster stamped per transaction, per kind
GAUGE_EXACT_LIMIT = 10_000  # rows: the depth gauge counts this many, then estimates
# Seconds a dashboard sample is kept (relay/samples.py): record_sample deletes older ones.
SAMPLES_KEPT_FOR = 86_400.0


@dataclasses.dataclass(slots=True)
class ClaimedRow:
    """One outbox row held by this relay's open claim. Read-only by convention: not frozen,
    because a frozen dataclass's __init__ sets each field through object.__setattr__, a cost
    paid for every row claimed (the same holds for PublishSpec and OutgoingMessage, built once
    a row too)."""

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
class SnapshotHolder:
    """What keeps vacuum from removing the outbox's dead rows (see _snapshot_holder)."""

    kind: str  # session, standby, slot or prepared
    xids: int  # how many transactions old its snapshot is
    seconds: float | None  # for how long it has held it, where PostgreSQL says
    pid: int | None
    name: str  # application name, slot name or prepared transaction's gid


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueueGauges:
    """The outbox's depth (exact up to GAUGE_EXACT_LIMIT rows), its oldest row's age, its
    dead rows and the oldest snapshot holding them back (if this role may see it)."""

    depth: int
    oldest_seconds: float
    dead_rows: int = 0
    # How many of the dead rows a snapshot holds back: those beyond the rows inserted since
    # the last vacuum (_dead_rows_held). The dead rows alone also count those autovacuum has
    # not reached yet, 100,000 and more between two rounds on a busy outbox.
    dead_rows_held: int = 0
    holder: SnapshotHolder | None = None
    # Rows held until an ETA ahead, rows waiting for a retry, dead letters (None: this role
    # may not count them), each counted up to GAUGE_EXACT_LIMIT + 1 rows; relays listening.
    held: int = 0
    retrying: int = 0
    dead_letters: int | None = None
    relays_listening: int = 0

    @property
    def due(self) -> int:
        """Rows due now: the depth less the held and retrying rows (as outbox_stats's due_now)."""
        return max(self.depth - self.held - self.retrying, 0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One relay's row of outbox_notify_sample_v1 (see sql/migrations/0006_samples.sql)."""

    relay: str
    host: str
    pid: int
    mode: str  # "listen" or "poll"
    seconds: float  # the interval this row covers
    published: int
    retried: int
    dead_lettered: int
    deferred: int
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    depth: int
    dead_by_task: Mapping[str, int]


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
    def session_proven(self) -> None: ...


# With 0, psycopg prepares a statement at its first execution (its default: the fifth). The
# claim is then parsed once per connection rather than at every claim (see
# ClaimStore.session_proven), from the first claim after a start on: with the default, the
# first five claims were parsed and planned afresh, which made the first batches after a start
# several times as slow as the next ones, and their rows the slowest of a latency run.
PREPARE_THRESHOLD = 0
# What a transaction pooler that does not track prepared statements answers: the statement
# is missing, its name is taken, or another client's statement of that name has other
# parameters.
PREPARED_REFUSED = (
    pg_errors.InvalidSqlStatementName,
    pg_errors.DuplicatePreparedStatement,
    pg_errors.ProtocolViolation,
)


INT8_OID = 20


def stable_int_types(conn: psycopg.Connection[Any]) -> None:
    """Send every Python int as a bigint on this connection.

    psycopg sends each int as the smallest type that holds its value (smallint, integer or
    bigint), and keeps a prepared statement per query and parameter types. A claim's
    positions change type as they move (an id past 32,767; LAST_ID once an index was read to
    its end), so each shape of the claim was prepared and planned again for every mix of
    types it met: several times over a relay's first claims, each in a batch's time.
    """
    for fmt in (pq.Format.TEXT, pq.Format.BINARY):
        conn.adapters.register_dumper(int, conn.adapters.get_dumper_by_oid(INT8_OID, fmt))


@dataclasses.dataclass(slots=True)
class Preparing:
    """Whether a relay's claim connections may prepare statements: one object, shared by its
    claim stores, so a refusal seen on one turns preparing off on all of them for good."""

    allowed: bool


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


def claim_text(claim_batch: LiteralString, recheck: bool, late: bool) -> LiteralString:
    """claim_batch without the parts that have nothing to read this time.

    With no row to recheck (or no transaction to look up), the part returns nothing anyway,
    but the server still sets up its scans and the lists of what it left: at one row per
    claim, that was a sixth of the claim's time (`make bench-versus`). bench.claim_designs
    times the same shapes.
    """
    left_out = [part for part, wanted in (("recheck", recheck), ("late", late)) if not wanted]
    return sql.without(claim_batch, *left_out)


class ClaimStore:
    """Owns the claim connection and runs the relay's claim-side queries on it."""

    def __init__(
        self,
        params: dict[str, Any],
        *,
        stale_timeout: float,
        frontier: Frontier | None = None,
        preparing: Preparing | None = None,
    ) -> None:
        self.params = params
        # Prepare statements once the LISTEN probe proves a session of our own (see
        # session_proven); not allowed when the alias's OPTIONS say, or the claims go elsewhere.
        self.preparing = preparing if preparing is not None else Preparing(allowed=False)
        self.prepare = False  # this connection's probe went through (session_proven)
        self.stale_timeout_ms = str(int(stale_timeout * 1000))
        self.queries = sql.queries()
        # The claim in its four shapes (with or without the recheck and late parts), each
        # converted to `$1` parameters once (see sql.positional), on first use.
        self.claim_shapes: dict[tuple[bool, bool], tuple[LiteralString, tuple[str, ...]]] = {}
        self.conn: psycopg.Connection[Any] | None = None
        # Where claims start: shared by a relay's claim connections and its LISTEN side.
        self.frontier = frontier if frontier is not None else Frontier()
        self.next_save = 0.0  # time.monotonic() of the next frontier save
        # Whether this role may count the dead letters (asked once per connection).
        self.dead_letters_readable: bool | None = None

    def connect(self) -> None:
        """Open the connection (closing a broken one first)."""
        self.close()
        params = {**KEEPALIVES, "connect_timeout": CONNECT_TIMEOUT, **self.params}
        params["application_name"] = CLAIM_APPLICATION_NAME
        with translated("connecting the claim connection"):
            self.conn = psycopg.connect(**params, autocommit=False)
        stable_int_types(self.conn)
        # A new connection may lead elsewhere (a failover, a DSN now behind a pooler): it
        # prepares once its own probe went through.
        self.prepare = False
        self.dead_letters_readable = None
        self.load_frontier()

    def load_frontier(self) -> None:
        """Start from the frontier a relay saved last (see load_frontier in sql/queries.sql),
        unless this relay has one; at every connection, check it against the database (a
        restore, a failover, a point-in-time recovery: Frontier.check), after stamping the
        rows copied in from another cluster (restamp_copied_rows)."""
        conn = self._connection()
        version = {"max_version": SCHEMA_VERSION}
        settings = {"timeout_ms": self.stale_timeout_ms}
        batch = {"limit": RESTAMP_BATCH}
        with self._statements("loading the saved frontier"), conn.pipeline():
            conn.execute(self.queries["set_claim_timeout"], settings)
            conn.execute(self.queries["ensure_frontier_row"], version)
            restamped = conn.execute(self.queries["restamp_copied_rows"], batch)
            cursor = conn.execute(self.queries["load_frontier"], version)
            conn.commit()
        [(n, unstamped)] = restamped.fetchall()
        total = n
        while n >= RESTAMP_BATCH and not unstamped:  # a restored backlog: a batch at a time
            with self._statements("stamping rows copied in"), conn.pipeline():
                conn.execute(self.queries["set_claim_timeout"], settings)
                restamped = conn.execute(self.queries["restamp_copied_rows"], batch)
                conn.commit()
            [(n, unstamped)] = restamped.fetchall()
            total += n
        if unstamped:
            log.warning(
                "outbox.copied_rows_unstamped",
                rows=unstamped,
                hint="rows with transaction ids this database has not handed out stay so: "
                "the trigger outbox_notify_restamp_v1 is disabled (ALTER TABLE ... ENABLE "
                "TRIGGER), or session_replication_role is replica",
            )
        elif total:
            log.info("outbox.copied_rows_stamped", rows=total)
        [(state, xmax, now)] = cursor.fetchall()  # one row, a frontier saved or not
        if not self.frontier.loaded:
            self.frontier.load(state)
        self.frontier.check(int(xmax), float(now), self._cluster(conn))

    def _cluster(self, conn: psycopg.Connection[Any]) -> str | None:
        """This database's cluster and timeline (cluster_identity), or None where the server
        does not tell (a role without the right, a managed service): logged as
        outbox.cluster_identity_unavailable, and Frontier.check compares txids only. Only a
        broken connection is an error."""
        with translated("reading the cluster's identity"):
            try:
                with conn.transaction():
                    row = conn.execute(self.queries["cluster_identity"]).fetchone()
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise
                log.info("outbox.cluster_identity_unavailable", error=str(exc).strip())
                return None
        return str(row[0]) if row and row[0] else None

    def close(self) -> None:
        """Save the frontier if the connection still works, then close it; an open claim is
        rolled back by the server."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.save_frontier()
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None

    def save_frontier(self) -> None:
        """Save the frontier now, in a transaction of its own (a stop, the end of a sweep)."""
        conn = self._connection()
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return  # inside a claim: its rows are held, it will save with it
        with self._statements("saving the frontier"), conn.pipeline():
            self._save(conn)
            conn.commit()

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            raise DatabaseUnavailable("the claim connection is not open")
        return self.conn

    def session_proven(self) -> None:
        """The LISTEN probe went through: this connection is a server session of our own.

        Django turns psycopg's prepared statements off (prepare_threshold None) because a
        transaction pooler may not track them; with the alias's OPTIONS silent on it, the
        relay turns them on for its claim connections once the probe, sent from the main
        claim connection to the LISTEN one, all three built from the same parameters, proves
        no transaction pooler is in between. Unprepared, the claim was planned at every
        claim, which cost the server more than running it (docs/deploy.md, "PgBouncer";
        `make bench-versus`). Called after every successful probe: each new connection
        waits for its own.
        """
        if not self.preparing.allowed or self.conn is None or self.conn.closed:
            return
        self.prepare = True
        self.conn.prepare_threshold = PREPARE_THRESHOLD
        self._prepare_claims()

    def _prepare_claims(self) -> None:
        """Prepare the claim in its four shapes, the finalising delete and the frontier's save
        before the first claim: each is planned once, now, instead of inside the first claim
        that needs it (a relay's first batches after a start, or a first row to recheck in the
        middle of a drain, paid for it). Each shape runs with LIMIT 0 and lists of one value
        that matches nothing, so its parameters have the types of a real claim's; it takes no
        row, and the transaction ends with a commit (release()), which keeps what was prepared.
        """
        conn = self._connection()
        values = {**self.frontier.params(), "limit": 0, "max_version": SCHEMA_VERSION}
        values["recheck"] = values["recheck"] or [0]  # ids start at 1
        values["late"] = values["late"] or ["0"]  # no transaction has txid 0
        try:
            with self._statements("preparing the claim"), conn.pipeline():
                conn.execute(
                    self.queries["set_claim_timeout"], {"timeout_ms": self.stale_timeout_ms}
                )
                for recheck in (False, True):
                    for late in (False, True):
                        text, names = self.claim_shape(recheck, late)
                        psycopg.RawCursor(conn).execute(text, [values[name] for name in names])
                conn.execute(self.queries["delete_published"], {"ids": [0]})
                # The frontier as loaded, saved again: the first claim has no save to make.
                self.next_save = time.monotonic() + FRONTIER_SAVE_INTERVAL
                self._save(conn)
        finally:
            self.release()

    def _refused(self, exc: BaseException | None) -> None:
        """Prepared statements off for good if `exc` is the server refusing one of them."""
        if not (isinstance(exc, PREPARED_REFUSED) and self.prepare):
            return
        self.preparing.allowed = self.prepare = False
        if self.conn is not None and not self.conn.closed:
            self.conn.prepare_threshold = None
        log.warning("outbox.prepared_statements_refused", error=str(exc))

    @contextlib.contextmanager
    def _statements(self, what: str) -> Iterator[None]:
        """translated(), and prepared statements off for good if the server refuses them."""
        try:
            with translated(what):
                yield
        except DatabaseUnavailable as exc:
            self._refused(exc.__cause__)
            raise

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[Claim]:
        """Claim up to `limit` rows; the claim lasts until the block ends (commit or rollback).

        `lock_wait` (seconds), for a claim made while this relay holds another one: if the
        table stays locked that long (a lock request such as TRUNCATE or ALTER TABLE queued
        behind the other claim), or the claim statement runs that long for any reason, give up
        and raise ClaimWouldWait instead of waiting for it.
        """
        conn = self._connection()
        asked = self.frontier.params()
        try:
            with self._statements("claiming a batch"), conn.pipeline():
                conn.execute(
                    self.queries["set_claim_timeout"], {"timeout_ms": self.stale_timeout_ms}
                )
                if lock_wait is not None:
                    wait = str(max(1, int(lock_wait * 1000)))
                    conn.execute(self.queries["set_claim_lock_wait"], {"wait": wait})
                self._save_frontier_now_and_then(conn)
                values = {**asked, "limit": limit, "max_version": SCHEMA_VERSION}
                text, names = self.claim_shape(bool(asked["recheck"]), bool(asked["late"]))
                cursor = psycopg.RawCursor(conn)
                cursor.execute(text, [values[name] for name in names])
                if lock_wait is not None:  # the finalising statements wait as usual
                    conn.execute(self.queries["reset_claim_lock_wait"])
                    conn.execute(self.queries["reset_claim_statement_timeout"])
        except DatabaseUnavailable as exc:
            gave_up = (pg_errors.LockNotAvailable, pg_errors.QueryCanceled)
            if lock_wait is not None and isinstance(exc.__cause__, gave_up) and not conn.broken:
                self.rollback()
                raise ClaimWouldWait(str(exc.__cause__)) from exc
            raise
        with self._statements("claiming a batch"):
            rows, taken, seen = claimed_rows(cursor.fetchall(), limit)
        self.frontier.absorb(asked, taken, seen)
        ids = [row.id for row in rows]
        self.frontier.hold(ids)
        claim = Claim(self, rows)
        try:
            yield claim
        except BaseException:
            self.rollback()
            self.frontier.settle(ids, released=ids)
            raise
        if not claim.finished:
            self.release()
            self.frontier.settle(ids, released=ids)

    def claim_shape(self, recheck: bool, late: bool) -> tuple[LiteralString, tuple[str, ...]]:
        """claim_text's shape in `$1` parameters, converted once per shape. Each shape is a
        statement of its own, prepared on its own."""
        key = (recheck, late)
        shape = self.claim_shapes.get(key)
        if shape is None:
            shape = sql.positional(claim_text(self.queries["claim_batch"], recheck, late))
            self.claim_shapes[key] = shape
        return shape

    def _save_frontier_now_and_then(self, conn: psycopg.Connection[Any]) -> None:
        """Queue a save of the frontier in the claim's pipeline, every FRONTIER_SAVE_INTERVAL."""
        now = time.monotonic()
        if now < self.next_save:
            return
        self.next_save = now + FRONTIER_SAVE_INTERVAL
        self._save(conn)

    def _save(self, conn: psycopg.Connection[Any]) -> None:
        state = Json(self.frontier.state())
        conn.execute(self.queries["save_frontier"], {"state": state, "max_version": SCHEMA_VERSION})

    def release(self) -> None:
        """End a claim that changed nothing (it found no rows, or its rows are let go
        untouched): commit, which frees the row locks as a rollback would and keeps the
        frontier save queued with the claim.

        Not a rollback: psycopg forgets every statement it prepared on a connection that rolls
        back (it cannot tell what the rollback undid), and the claim would be planned again
        at each of its next executions, until prepared anew: a relay that found nothing after
        a wake or a linger would do that at every wake. A transaction that failed is rolled
        back (so are the rarer ends: an error, a ClaimWouldWait).
        """
        conn = self.conn
        if conn is None or conn.closed:
            return
        if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
            self.rollback()
            return
        try:
            conn.commit()
        except psycopg.Error:
            # As with a rollback: the server lets the rows go with the session, and the next
            # statement on a broken connection says so.
            self.rollback()

    def rollback(self) -> None:
        """Release every row of the open claim untouched."""
        if self.conn is not None and not self.conn.closed:
            with contextlib.suppress(psycopg.Error):
                self.conn.rollback()

    def finish(self, outcome: Outcome) -> None:
        """Apply a batch's outcome and commit, in one pipelined round trip."""
        conn = self._connection()
        with self._statements("finalising a batch"), conn.pipeline():
            if outcome.retry or outcome.dead:
                conn.execute(self.queries["finalize_batch"], finalize_params(outcome))
            elif outcome.published:
                conn.execute(self.queries["delete_published"], {"ids": list(outcome.published)})
            conn.commit()

    def peek(self) -> Peek:
        """Check for claimable and held work and the next retry time, in one statement."""
        conn = self._connection()
        params = {**self.frontier.params(), "max_version": SCHEMA_VERSION}
        # In a transaction of its own, with the claim's plan settings (they are local to it,
        # so safe behind a pooler); the row it may lock to test is let go at the commit.
        with self._statements("peeking at the outbox"), conn.pipeline():
            conn.execute(self.queries["set_claim_timeout"], {"timeout_ms": self.stale_timeout_ms})
            cursor = conn.execute(self.queries["peek"], params)
            conn.commit()
        row = cursor.fetchone()
        claimable, due, next_due_in = row or (False, False, None)
        return Peek(claimable=bool(claimable), due=bool(due), next_due_in=next_due_in)

    def send_probe(self, payload: str) -> None:
        """NOTIFY the LISTEN probe channel from this connection and commit (Listener.probe)."""
        conn = self._connection()
        with self._statements("sending the LISTEN probe"):
            conn.execute(self.queries["notify_probe"], {"payload": payload})
            conn.commit()

    def queue_gauges(self) -> QueueGauges:
        """The gauges of queue_gauges, read from the frontier, in one round trip.

        In a transaction of its own with the claim's plan settings (read the indexes from the
        frontier whatever the statistics say). A failure that leaves the connection usable (a
        permission, a timeout) raises GaugeUnavailable, so a gauge never costs the relay its
        connections.
        """
        conn = self._connection()
        params = {**self.frontier.params(with_held=True), **gauge_params()}
        with self._statements("sampling queue gauges"):
            try:
                readable = self._dead_letters_readable(conn)
                with conn.pipeline():
                    conn.execute(
                        self.queries["set_claim_timeout"], {"timeout_ms": self.stale_timeout_ms}
                    )
                    cursor = conn.execute(self.queries["queue_gauges"], params)
                    letters = None
                    if readable:
                        limit = {"limit": params["limit"]}
                        letters = conn.execute(self.queries["count_dead_letters"], limit)
                row = cursor.fetchone()
                dead_letters = None if letters is None else _count(letters.fetchone())
                conn.commit()
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise  # translated into DatabaseUnavailable
                self._refused(exc)
                self.rollback()
                raise GaugeUnavailable(f"sampling queue gauges: {exc}") from exc
        return gauges_from(row, dead_letters=dead_letters)

    def _dead_letters_readable(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether this role may count the dead letters: asked once per connection, so a role
        without the grant (an older sql/relay_role.sql) loses that gauge, not the others."""
        if self.dead_letters_readable is None:
            row = conn.execute(self.queries["dead_letters_readable"]).fetchone()
            conn.commit()
            self.dead_letters_readable = bool(row and row[0])
        return self.dead_letters_readable

    def record_sample(self, sample: Sample) -> None:
        """Write one dashboard sample (record_sample) and commit, in a transaction of its own.

        Like the gauges, a failure that leaves the connection usable (a missing table or
        privilege) raises GaugeUnavailable: a sample never costs the relay its connections.
        """
        conn = self._connection()
        with self._statements("recording a sample"):
            try:
                conn.execute(self.queries["record_sample"], sample_params(sample))
                conn.commit()
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise  # translated into DatabaseUnavailable
                self._refused(exc)
                self.rollback()
                raise GaugeUnavailable(f"recording a sample: {exc}") from exc


class Claim:
    """The rows of one open claim, and the way to end it."""

    def __init__(self, store: ClaimStore, rows: list[ClaimedRow]) -> None:
        self.store = store
        self.rows = rows
        self.finished = False

    def finish(self, outcome: Outcome) -> None:
        """Apply the outcome and commit; rows not named in it are released untouched."""
        frontier = self.store.frontier
        ids = [row.id for row in self.rows]
        try:
            self.store.finish(outcome)
        except BaseException:
            # Committed or not, the rows are free or gone: look at them again by id.
            frontier.settle(ids, released=ids)
            raise
        self.finished = True
        ended = {*outcome.published, *(r.id for r in outcome.retry), *(d.id for d in outcome.dead)}
        frontier.settle(ids, released=[i for i in ids if i not in ended])


def claimed_rows(
    records: list[tuple[Any, ...]], limit: int
) -> tuple[list[ClaimedRow], list[Taken], Seen]:
    """The rows claim_batch returned, once each, and what it reported (its part -1 row).

    Columns come in ClaimedRow's field order after the part (see claim_batch). A row found by
    two parts (a row to recheck that is also past the frontier) is taken once.
    """
    rows: list[ClaimedRow] = []
    taken: list[Taken] = []
    seen: Seen | None = None
    ids: set[int] = set()
    for part, *values, txid, retry_after, meta in records:
        if part < 0:
            seen = Seen.from_json(limit, meta)
            continue
        row_id = values[0]
        if row_id in ids:
            continue
        ids.add(row_id)
        rows.append(ClaimedRow(*values))
        taken.append(Taken(row_id, part, int(txid), retry_after))
    if seen is None:  # pragma: no cover - claim_batch always ends with its part -1 row
        raise DatabaseUnavailable("claiming a batch: the claim query returned no summary row")
    return rows, taken, seen


def gauge_params() -> dict[str, int]:
    """Parameters of the queue_gauges query."""
    return {"limit": GAUGE_EXACT_LIMIT + 1, "window": GAUGE_EXACT_LIMIT}


def _count(row: Sequence[Any] | None) -> int:
    return int(row[0]) if row else 0


def gauges_from(row: Sequence[Any] | None, *, dead_letters: int | None = None) -> QueueGauges:
    """The gauges from a queue_gauges row: the exact count while it stays under the cap."""
    columns = row or (0, *[None] * 9)
    counted, estimated, oldest, dead, dead_held, kind, xids, seconds, pid, name, *counts = columns
    # outbox_stats reads the vacuum columns alone, without the counts that follow them.
    held, retrying, listening = counts or (0, 0, 0)
    depth = int(counted)
    if depth > GAUGE_EXACT_LIMIT:
        depth = max(depth, round(estimated or 0.0))
    holder = None
    if kind is not None:
        holder = SnapshotHolder(
            kind=kind,
            xids=int(xids),
            seconds=None if seconds is None else float(seconds),
            pid=pid,
            name=name or "",
        )
    return QueueGauges(
        depth=depth,
        oldest_seconds=float(oldest or 0.0),
        dead_rows=int(dead or 0),
        dead_rows_held=int(dead_held or 0),
        holder=holder,
        held=int(held or 0),
        retrying=int(retrying or 0),
        dead_letters=dead_letters,
        relays_listening=int(listening or 0),
    )


def sample_params(sample: Sample) -> dict[str, Any]:
    """Parameters of the record_sample query."""
    params = dataclasses.asdict(sample)
    params["dead_by_task"] = Json(dict(sample.dead_by_task))
    return {**params, "limit": GAUGE_EXACT_LIMIT, "keep_seconds": SAMPLES_KEPT_FOR}


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
