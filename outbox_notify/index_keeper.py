"""The relay's index keeper: rebuilds the outbox's indexes once an old snapshot has let go.

After a snapshot held published rows back, autovacuum frees the table and truncates its empty
tail within a round or two, but the indexes keep the size they reached (a B-tree only reuses
its empty pages). Every CHECK_INTERVAL a thread of the relay looks, on a short connection of its
own: when no snapshot holds many dead rows back and the indexes take far more than the table
itself (outbox_notify/reindex.py, `bloated`), it rebuilds them with REINDEX INDEX CONCURRENTLY,
which blocks neither writers nor claims.

- Only after dead rows piled up: the keeper is armed when it starts and whenever a look finds
  more than `refuse_above` dead rows, and disarmed by a rebuild that went through, so a queue
  that merely drained (its table truncated, its indexes at their usual size) is left alone.
  It waits while more than `refuse_above` of them are held back (a vacuum had to leave them:
  a rebuild would keep them), whoever holds them, seen or not. An invalid copy left by an
  interrupted rebuild is dropped whether armed or not.
- One rebuild at a time, relays and `outbox_reindex` alike (a session advisory lock); at most
  once per MIN_GAP per relay; a long transaction in the way ends the attempt at the first
  index that waited LOCK_WAIT for it.
- Only on a session of its own: the relay's connection parameters once its LISTEN probe has
  proven them one (`session()`), since its lock_timeout and advisory lock are session state
  that a transaction pooler would hand to other clients.
- A role that does not own the indexes cannot rebuild them: the keeper then warns
  (outbox.reindex_needed) and `manage.py outbox_reindex`, run as the owner, does it.

The thread shares nothing with the relay loop but the process: a keeper that fails logs and
tries again at its next look (MIN_GAP after an attempt that took the lock), and the relay
never waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import structlog

from outbox_notify import reindex, stats
from outbox_notify.relay.store import CONNECT_TIMEOUT, KEEPALIVES

log = structlog.get_logger("outbox_notify")

APPLICATION_NAME = "outbox_notify.reindex"
CHECK_INTERVAL = 60.0  # seconds between two looks at the outbox's sizes
MIN_GAP = 600.0  # seconds after a rebuild (or an attempt) before this relay tries again
WARNING_INTERVAL = 1800.0  # seconds between two outbox.reindex_needed warnings
# Seconds one index's rebuild waits for the transactions running when it began. Short: while
# it waits it holds a lock that autovacuum and a migration's ALTER TABLE queue behind.
LOCK_WAIT = 10.0
# Dead rows past which a snapshot holding them defers the rebuild (a rebuilt index would keep
# them: outbox_reindex refuses at the same count), and a look arms the keeper.
REFUSE_ABOVE = 100_000
STOP_WAIT = 5.0  # seconds stop() waits for the thread, a cancelled rebuild included


class IndexKeeper:
    """Looks at the outbox's index sizes now and then, and rebuilds them when bloated."""

    def __init__(
        self,
        params: dict[str, Any],
        *,
        session: Callable[[], bool] = lambda: True,
        interval: float | None = None,
        min_bytes: int | None = None,
        refuse_above: int = REFUSE_ABOVE,
    ) -> None:
        """`session`: whether `params` give a session of its own right now. `interval` and
        `min_bytes` default to CHECK_INTERVAL and reindex.BLOAT_MIN_BYTES."""
        self.params = {
            **KEEPALIVES,
            "connect_timeout": CONNECT_TIMEOUT,
            **params,
            "application_name": APPLICATION_NAME,
        }
        self.session = session
        self.interval = CHECK_INTERVAL if interval is None else interval
        self.min_bytes = reindex.BLOAT_MIN_BYTES if min_bytes is None else min_bytes
        self.refuse_above = refuse_above
        self.armed = True
        self.next_try = 0.0
        self.next_warning = 0.0
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()  # guards `conn` between the thread and stop()
        self.conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> IndexKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="outbox-index-keeper", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread, cancelling a rebuild in progress (the next look drops what it left)."""
        self.stopping.set()
        with self.lock:
            conn = self.conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=STOP_WAIT)
        if self.thread is not None:
            self.thread.join(STOP_WAIT)

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.check()
            except Exception as exc:  # a keeper never takes the relay down
                if not self.stopping.is_set():
                    log.warning("outbox.reindex_failed", error=" ".join(str(exc).split()))

    # -- one look ---------------------------------------------------------------------------

    def check(self) -> str:
        """Look once and act; what it found: 'pooled' (no session of its own), 'held', 'fine',
        'waiting' (MIN_GAP since its last attempt), 'not owned', 'busy' (another rebuild is
        running), 'rebuilt' or 'stopping'."""
        if not self.session():
            return "pooled"
        with self._connected() as conn:
            if self.stopping.is_set():
                return "stopping"
            cur = conn.cursor()
            # Its own session, closed after the look: no statement timeout of the alias's
            # OPTIONS cuts a rebuild short (it would leave an invalid copy behind).
            cur.execute(stats.queries()["keeper_session"])
            return self._look(cur, time.monotonic())

    def _look(self, cur: Any, now: float) -> str:
        horizon = stats.vacuum_horizon(cur)
        if horizon.dead_rows > self.refuse_above:
            # Once autovacuum has removed them, the table's tail is truncated and the indexes
            # stand out against it.
            self.armed = True
        if horizon.dead_rows_held > self.refuse_above:
            # A vacuum had to leave them, whether or not this role can see what holds them: a
            # rebuild now would keep them. Rows that only wait for autovacuum's next round (a
            # busy outbox deletes 100,000 and more between two) do not count.
            return "held"
        found = reindex.indexes(cur)
        heap = reindex.table_bytes(cur)
        leftover = any(index.leftover for index in found)
        if not (self.armed or leftover) or not reindex.bloated(heap, found, self.min_bytes):
            return "fine"
        if now < self.next_try:
            return "waiting"
        size = sum(index.bytes for index in found if not index.leftover)
        if not all(index.owned for index in found):
            if now >= self.next_warning:
                self.next_warning = now + WARNING_INTERVAL
                log.warning(
                    "outbox.reindex_needed",
                    index_bytes=size,
                    table_bytes=heap,
                    hint="run manage.py outbox_reindex as the tables' owner (docs/operations.md)",
                )
            return "not owned"
        return self._rebuild(cur, now)

    def _rebuild(self, cur: Any, now: float) -> str:
        """Take the rebuild lock and rebuild, if the indexes are still bloated once it holds it."""
        cur.execute(stats.queries()["try_reindex_lock"])
        locked = cur.fetchone()
        if not (locked and locked[0]):
            return "busy"
        self.next_try = now + MIN_GAP
        try:
            found = reindex.indexes(cur)  # another rebuild may have ended before the lock
            heap = reindex.table_bytes(cur)
            if not reindex.bloated(heap, found, self.min_bytes):
                self.armed = False
                return "fine"
            size = sum(index.bytes for index in found if not index.leftover)
            log.info("outbox.reindex_started", index_bytes=size, table_bytes=heap)
            started = time.monotonic()
            done = reindex.rebuild(
                cur,
                found,
                min_size=0,
                lock_wait=LOCK_WAIT,
                say=lambda line: None,
                first_failure_ends=True,
                stopping=self.stopping.is_set,
            )
        finally:
            cur.execute(stats.queries()["reindex_unlock"])
        # An attempt that gave up stays armed: the next one, MIN_GAP later, tries again.
        self.armed = bool(done.failed or done.undropped)
        log.info(
            "outbox.reindex_done",
            before_bytes=done.before,
            after_bytes=done.after,
            seconds=round(time.monotonic() - started, 1),
            gave_up=list(done.failed + done.undropped) or None,
        )
        return "rebuilt"

    @contextlib.contextmanager
    def _connected(self) -> Any:
        """A connection for one look, closed after it: the keeper holds none between looks."""
        conn = psycopg.connect(**self.params, autocommit=True)
        with self.lock:
            self.conn = conn
        try:
            yield conn
        finally:
            with self.lock:
                self.conn = None
            conn.close()
