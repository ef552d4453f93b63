"""The LISTEN connection: wake-ups, the sleep handshake, and waiting without polling.

It runs in autocommit and never claims rows or sits in a transaction, so it can never hold
back the notification queue. Driver errors become DatabaseUnavailable here.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psycopg
from psycopg import errors as pg_errors

from outbox_notify import sql
from outbox_notify.exceptions import DatabaseUnavailable
from outbox_notify.relay.config import LISTEN_APPLICATION_NAME, PROBE_CHANNEL
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.store import (
    CONNECT_TIMEOUT,
    KEEPALIVES,
    PREPARE_THRESHOLD,
    Peek,
    stable_int_types,
    translated,
)
from outbox_notify.serialization import SCHEMA_VERSION

PROBE_TIMEOUT = 2.0  # seconds to wait for the probe notification
IDLE_SESSION_TIMEOUT_SINCE = 140000  # server_version that has idle_session_timeout


class LockState(enum.Enum):
    """The outcome of trying to take the wake lock before sleeping."""

    HELD = "held"  # this relay sleeps; writers will notify
    PEER = "peer"  # another relay sleeps with the lock; its wake-ups reach us too
    WRITERS = "writers"  # writers' open transactions hold it: their rows come at commit


class Wake(enum.Enum):
    """Why a wait ended."""

    NOTIFIED = "notified"
    TIMEOUT = "timeout"
    SIGNAL = "signal"


class Outwait(enum.Enum):
    """How one wait behind writers that hold the wake lock ended."""

    LOCKED = "locked"  # the writers finished: this relay holds the lock now
    CLAIMABLE = "claimable"  # a row is claimable: drain (the lock was not asked for)
    TIMED_OUT = "timed_out"  # still held after lock_wait


class WakeChannel(Protocol):
    """What the relay loop needs from its LISTEN side (Listener; a fake in unit tests)."""

    wake_fd: int | None  # readable when a stop signal arrived (None: no signal wake-ups)
    holds_lock: bool  # this relay holds the wake lock (taken to sleep, kept through a wake)

    @property
    def connected(self) -> bool: ...

    def connect(self) -> None: ...
    def probe(self, send: Callable[[str], None]) -> bool: ...
    def listen(self) -> None: ...
    def close(self) -> None: ...
    def take_lock(self) -> LockState: ...
    def await_writers(self) -> Outwait: ...
    def lock_holder(self) -> LockState: ...
    def release_lock(self) -> None: ...
    def peek(self) -> Peek: ...
    def drain_pending(self) -> int: ...
    def wait(self, timeout: float) -> Wake: ...
    def may_keep_lock(self, silent_for: float) -> bool: ...


class Listener:
    """Owns the LISTEN connection of one relay."""

    def __init__(
        self,
        params: dict[str, Any] | str,
        *,
        lock_wait: float,
        wake_fd: int | None,
        stale_timeout: float = 30.0,
        frontier: Frontier | None = None,
        auto_prepare: bool = False,
    ) -> None:
        self.params = params
        # Prepare the peek and the lock statements once listen() starts: a LISTEN that works
        # is a server session of our own (see ClaimStore.session_proven).
        self.auto_prepare = auto_prepare
        # The relay's claim positions: the peek and the wait behind writers read from them.
        self.frontier = frontier if frontier is not None else Frontier()
        self.lock_wait_ms = str(max(1, int(lock_wait * 1000)))
        self.stale_timeout = stale_timeout
        self.stale_timeout_ms = str(int(stale_timeout * 1000))
        self.bounded = False  # server has idle_session_timeout (PostgreSQL 14+)
        self.last_statement = 0.0  # time.monotonic() when a statement last ran here
        self.wake_fd = wake_fd
        self.queries = sql.queries()
        self.conn: psycopg.Connection[Any] | None = None
        self.holds_lock = False

    def connect(self) -> None:
        """Open the connection; `listen()` starts listening once `probe()` says it works."""
        self.close()
        with translated("connecting the LISTEN connection"):
            options: dict[str, Any] = {**KEEPALIVES, "connect_timeout": CONNECT_TIMEOUT}
            options["application_name"] = LISTEN_APPLICATION_NAME
            if isinstance(self.params, str):
                conn = psycopg.connect(self.params, autocommit=True, **options)
            else:
                conn = psycopg.connect(
                    **{**options, **self.params, **{"application_name": LISTEN_APPLICATION_NAME}},
                    autocommit=True,
                )
        stable_int_types(conn)
        self.conn = conn
        self.holds_lock = False
        self.bounded = conn.info.server_version >= IDLE_SESSION_TIMEOUT_SINCE

    def listen(self) -> None:
        """LISTEN on the outbox channel and set the session's lock timeout for take_lock().

        Only after a successful probe: behind a transaction pooler this session state would
        stay on whichever server connection the pooler picked, for other clients to inherit.
        """
        conn = self._connection()
        with translated("starting to LISTEN"):
            conn.execute(self.queries["listen"])
            conn.execute(self.queries["set_lock_timeout"], {"timeout_ms": self.lock_wait_ms})
            conn.execute(self.queries["set_listen_plan"])
        if self.auto_prepare:
            conn.prepare_threshold = PREPARE_THRESHOLD

    def close(self) -> None:
        """Close the connection (the server drops our lock and LISTEN with it)."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None
        self.holds_lock = False

    @property
    def connected(self) -> bool:
        """Whether the connection is open (it may still turn out broken when used)."""
        return self.conn is not None

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            raise DatabaseUnavailable("the LISTEN connection is not open")
        return self.conn

    def probe(self, send: Callable[[str], None]) -> bool:
        """Check that a notification sent from another session reaches this connection.

        `send(payload)` must NOTIFY from the claim connection, as a writer's trigger would.
        Through a transaction-pooling PgBouncer our LISTEN belongs to a server connection
        that goes back to the pool between statements, so the notification never comes back
        (a notification sent through this same connection could: the pooler may hand it the
        same server connection). It also fails when the LISTEN DSN reaches another database
        than the claims do.
        """
        conn = self._connection()
        payload = f"{os.getpid()}-{time.monotonic_ns()}"
        with translated("probing LISTEN/NOTIFY"):
            conn.execute(self.queries["listen_probe"])
        send(payload)
        received = False
        deadline = time.monotonic() + PROBE_TIMEOUT
        with translated("probing LISTEN/NOTIFY"):
            # Other relays' probes may arrive first: wait for ours until the deadline.
            while not received and (remaining := deadline - time.monotonic()) > 0:
                received = any(
                    n.channel == PROBE_CHANNEL and n.payload == payload
                    for n in conn.notifies(timeout=remaining, stop_after=1)
                )
            conn.execute(self.queries["unlisten_probe"])
        return received

    def take_lock(self) -> LockState:
        """Try, for at most lock_wait, to take the wake lock before sleeping."""
        conn = self._connection()
        with self._closing_on_failure("taking the wake lock"):
            try:
                if self.bounded:
                    conn.execute(
                        self.queries["take_wake_lock_bounded"],
                        {"timeout_ms": self.stale_timeout_ms},
                    )
                else:
                    conn.execute(self.queries["take_wake_lock"])
            except pg_errors.LockNotAvailable:
                return self._holder(conn)
        self.last_statement = time.monotonic()
        self.holds_lock = True
        return LockState.HELD

    def await_writers(self) -> Outwait:
        """One statement: CLAIMABLE at once, or queue up to lock_wait for the lock writers hold.

        The relay calls it instead of draining again while writers' open transactions hold
        the lock (take_lock said WRITERS): the writers' commit grants the queued request at
        once, and a claimable row (a retry falling due, a writer that committed unseen) ends
        the wait on the next call.
        """
        conn = self._connection()
        query = self.queries["await_wake_lock_bounded" if self.bounded else "await_wake_lock"]
        params = {
            **self.frontier.params(),
            "max_version": SCHEMA_VERSION,
            "timeout_ms": self.stale_timeout_ms,
        }
        with self._closing_on_failure("waiting for the wake lock"):
            try:
                row = conn.execute(query, params).fetchone()
            except pg_errors.LockNotAvailable:
                return Outwait.TIMED_OUT
        if row and row[0]:
            return Outwait.CLAIMABLE
        self.last_statement = time.monotonic()
        self.holds_lock = True
        return Outwait.LOCKED

    def lock_holder(self) -> LockState:
        """Who holds the wake lock now: PEER (a sleeping relay) or WRITERS (or nobody)."""
        conn = self._connection()
        with self._closing_on_failure("looking up the wake lock's holder"):
            return self._holder(conn)

    def _holder(self, conn: psycopg.Connection[Any]) -> LockState:
        row = conn.execute(self.queries["wake_lock_holder"]).fetchone()
        return LockState.PEER if row and row[0] else LockState.WRITERS

    @contextlib.contextmanager
    def _closing_on_failure(self, what: str) -> Iterator[None]:
        """translated(), and a connection that failed is closed (its lock state is unknown)."""
        try:
            with translated(what):
                yield
        except DatabaseUnavailable:
            self.close()
            raise

    def release_lock(self) -> None:
        """Give the wake lock back: from now on writers stop notifying."""
        if not self.holds_lock:
            return
        conn = self._connection()
        with translated("releasing the wake lock"):
            conn.execute(
                self.queries["release_wake_lock_bounded" if self.bounded else "release_wake_lock"]
            )
        self.holds_lock = False

    def peek(self) -> Peek:
        """The relay's one idle query, in autocommit (the row lock it tests is let go at once)."""
        conn = self._connection()
        with translated("peeking at the outbox"):
            params = {**self.frontier.params(), "max_version": SCHEMA_VERSION}
            row = conn.execute(self.queries["peek"], params).fetchone()
        self.last_statement = time.monotonic()
        claimable, due, next_due_in = row or (False, False, None)
        return Peek(claimable=bool(claimable), due=bool(due), next_due_in=next_due_in)

    def may_keep_lock(self, silent_for: float) -> bool:
        """Whether the wake lock may stay held while this connection says nothing for
        `silent_for` more seconds (a drain on the claim connection).

        On PostgreSQL 14+ the session holding the lock ends after --stale-timeout of silence
        (take_wake_lock_bounded), so that a relay frozen asleep loses it: a relay keeps the
        lock through a drain only when the server would not end its session meanwhile.
        """
        if not self.bounded:
            return True
        return time.monotonic() - self.last_statement + silent_for < self.stale_timeout

    def drain_pending(self) -> int:
        """Consume notifications already received; return how many there were."""
        conn = self._connection()
        with translated("reading notifications"):
            return sum(1 for _ in conn.notifies(timeout=0))

    def wait(self, timeout: float) -> Wake:
        """Block until a notification, the timeout, or a byte on the wake-up fd (a signal)."""
        conn = self._connection()
        if self.drain_pending():
            return Wake.NOTIFIED
        deadline = time.monotonic() + max(0.0, timeout)
        fds = [conn.fileno()] + ([self.wake_fd] if self.wake_fd is not None else [])
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Wake.TIMEOUT
            readable, _, _ = select.select(fds, [], [], remaining)
            if self.wake_fd is not None and self.wake_fd in readable:
                _drain_fd(self.wake_fd)
                return Wake.SIGNAL
            if readable and self.drain_pending():
                return Wake.NOTIFIED


def _drain_fd(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while os.read(fd, 512):
            pass
