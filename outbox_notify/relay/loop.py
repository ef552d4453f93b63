"""The relay loop: drain, sleep until woken, repeat. Orchestration only.

drain:  claim a batch (row locks in an open transaction), publish it, finalise it in
        one round trip and commit; repeat until a batch comes back short. With a publisher
        that can have two batches in flight (RabbitMQ's confirms) and a second claim
        connection, the next batch is claimed and written while the broker confirms the
        previous one (see drain_overlapped).
sleep:  take the wake lock (writers notify from now on), peek once more for work that
        committed before the lock, then block on LISTEN until a notification, the next
        retry's due time, the sweep timer, or a signal.
outwait: when writers' open transactions hold the wake lock, queue for it one --lock-wait
        at a time (one statement each) instead of draining again: their commit hands the
        lock over at once, and a claimable row or another writer's notification ends it.

The core imports nothing from Django: runner.py builds its seams (Store, WakeChannel,
Publisher, Metrics, Reporter) from the settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from outbox_notify.exceptions import (
    BrokerUnavailable,
    DatabaseUnavailable,
    GaugeUnavailable,
)
from outbox_notify.metrics import Metrics, NullMetrics
from outbox_notify.relay import messages
from outbox_notify.relay._drain import BatchDrain, Prepared
from outbox_notify.relay._sleeper import Sleeper
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.listener import Wake, WakeChannel
from outbox_notify.relay.outcome import Decided, OutcomePolicy
from outbox_notify.relay.policy import Backoff, Breaker, Clock, SystemClock
from outbox_notify.relay.publisher import (
    Pending,
    PublishDeadline,
    Publisher,
    can_overlap,
    overlaps,
    start,
)
from outbox_notify.relay.reporting import (
    LogReporter,
    MetricsReporter,
    Reporter,
    Reporters,
)
from outbox_notify.relay.store import (
    ClaimedRow,
    ClaimWouldWait,
    OpenClaim,
    Peek,
    QueueGauges,
    Store,
)

log = structlog.get_logger("outbox_notify")


@dataclasses.dataclass(eq=False)
class _InFlight:
    """A claimed batch written to the broker, its outcome still to come (drain_overlapped)."""

    claiming: contextlib.AbstractContextManager[OpenClaim]
    claim: OpenClaim
    ready: list[messages.OutgoingMessage]
    undecodable: list[tuple[ClaimedRow, str]]
    started: float
    claim_end: float  # monotonic: when its last broker step must have ended
    full: bool  # the claim came back full: there is probably more to claim
    pending: Pending | None = None  # set once its publishing started

    @property
    def backend_calls(self) -> bool:
        """Whether publishing it makes result-backend calls first (chords): they have no
        deadline of their own, so they never run while another claim waits."""
        return any(m.spec.backend_calls for m in self.ready)


class _Finalise(enum.Enum):
    """claim_beside(): the batch in flight must be finalised before the next claim."""

    FIRST = 1


class Relay:
    """One relay process: owns a claim store, a listener (unless polling) and a publisher."""

    RECONNECT_BASE = 0.1  # seconds
    RECONNECT_CAP = 10.0  # seconds
    DUE_SLACK = 0.001  # seconds added to a retry's due time so it is due when we wake
    GAUGE_INTERVAL = 15.0  # seconds between gauge samples with metrics on
    # Seconds between gauge samples with metrics off: only the dead-rows warning reads them.
    VACUUM_CHECK_INTERVAL = 60.0
    # Dead rows in the outbox past which the relay warns (outbox.vacuum_held_back), at most
    # once per VACUUM_WARNING_INTERVAL seconds: claims do not slow down, but the table grows.
    DEAD_ROWS_WARNING = 100_000
    VACUUM_WARNING_INTERVAL = 300.0
    LIVENESS_MIN_INTERVAL = 1.0  # seconds: touch the liveness file no more often than this
    BUSY_LINGER = 0.002  # seconds between drains while rows keep coming (no sleep, no NOTIFY)
    # Rows a drain must have found for the relay to linger rather than sleep. Below it, the
    # arrival rate is low enough that a NOTIFY per commit is cheap, and waking on it is faster.
    LINGER_THRESHOLD = 4
    # Seconds a claim made beside the one in flight may wait for the table's lock before it
    # gives up (a TRUNCATE or ALTER TABLE queued behind the claim in flight would otherwise
    # wait for the relay, and the relay for it).
    OVERLAP_LOCK_WAIT = 0.5

    def __init__(
        self,
        config: RelayConfig,
        *,
        store: Store,
        listener: WakeChannel | None,
        publisher: Publisher,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        reporters: Sequence[Reporter] = (),
        spare_store: Store | None = None,
    ) -> None:
        self.config = config
        self.store = store
        # A second claim connection, used only to claim the next batch while the previous one
        # awaits its confirms (a publisher that overlaps batches): see drain_overlapped.
        self.spare_store = spare_store
        self.listener = listener
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.metrics = metrics or NullMetrics()
        self.reporters = Reporters(
            [LogReporter(per_batch=config.log_batches), MetricsReporter(self.metrics), *reporters]
        )
        self.policy = OutcomePolicy(config, Backoff(config.backoff_time, config.max_backoff))
        self.breaker = Breaker(config.breaker_threshold, config.broker_outage_cooldown, self.clock)
        self.reconnect_backoff = Backoff(self.RECONNECT_BASE, self.RECONNECT_CAP)
        self.polling = listener is None or config.poll_only
        self.stop_requested_at: float | None = None
        self.stop_announced = False
        self.connected = False
        self.next_gauges = 0.0
        self.next_vacuum_warning = 0.0
        self.next_touch = 0.0
        self.drained = 0
        self.batches = BatchDrain(self)
        self.sleeper = Sleeper(self)

    # -- lifecycle -------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop claiming; finish the batch in hand within shutdown_timeout, then return.

        Called from the SIGTERM handler, which runs between two bytecodes of the main thread,
        possibly while that thread holds a lock (structlog's PrintLogger writes under one that
        is not reentrant): so it only records the time. announce_stop() logs it, from the loop.
        """
        if self.stop_requested_at is None:
            self.stop_requested_at = self.clock.monotonic()

    def announce_stop(self) -> None:
        """Log a requested stop once (outbox.relay_stopping), from the loop, never a handler."""
        if self.stop_requested_at is not None and not self.stop_announced:
            self.stop_announced = True
            log.info(
                "outbox.relay_stopping",
                shutdown_timeout=self.config.shutdown_timeout,
                since_signal=round(self.clock.monotonic() - self.stop_requested_at, 3),
            )

    @property
    def stopping(self) -> bool:
        if self.stop_requested_at is None:
            return False
        self.announce_stop()
        return True

    def run(self) -> None:
        """Run until request_stop(); reconnects on its own after database failures."""
        log.info(
            "outbox.relay_started",
            mode="poll" if self.polling else "listen",
            batch_size=self.config.batch_size,
        )
        attempt = 0
        try:
            while not self.stopping:
                try:
                    self.ensure_connected()
                    attempt = 0
                    self.cycle()
                except DatabaseUnavailable as exc:
                    self.disconnect()
                    delay = self.reconnect_backoff.delay(attempt)
                    attempt += 1
                    log.warning(
                        "outbox.database_unavailable", error=str(exc), retry_in=round(delay, 3)
                    )
                    self.pause(delay)
                    # Still alive while the database is away: a restart would not help.
                    self.touch_liveness()
        finally:
            self.announce_stop()
            self.disconnect()
            self.publisher.close()
            log.info("outbox.relay_stopped")

    def ensure_connected(self) -> None:
        """Connect what is not connected; a fresh connection is followed by a full sweep."""
        if self.connected:
            return
        self.store.connect()
        if self.spare_store is not None:
            self.spare_store.connect()
        if self.listener is not None and not self.config.poll_only:
            self.listener.connect()
            if self.listener.probe(self.store.send_probe):
                self.listener.listen()
                self.polling = False
            else:
                self.polling = True
                self.listener.close()  # useless for wake-ups, and it would sit idle
                log.warning(
                    "outbox.listen_unavailable",
                    reason="a notification sent from the claim connection never reached the "
                    "LISTEN connection (a transaction-pooling PgBouncer, or a LISTEN DSN for "
                    "another database?); polling every sweep interval instead",
                    sweep_interval=self.config.sweep_interval,
                )
        self.connected = True
        log.info("outbox.database_connected", mode="poll" if self.polling else "listen")

    def disconnect(self) -> None:
        """Close both database connections (open claims are rolled back by the server)."""
        if self.listener is not None:
            self.listener.close()
        self.store.close()
        if self.spare_store is not None:
            self.spare_store.close()
        self.connected = False

    # -- one cycle -----------------------------------------------------------------------

    def cycle(self) -> None:
        """Drain, then sleep until there may be work again."""
        self.touch_liveness()
        cooldown = self.breaker.wait_time()
        if cooldown > 0:
            self.pause(min(cooldown, self.config.liveness_interval))
            return
        if not self.drain() or self.stopping:
            return
        self.sample_gauges()
        if self.drained >= self.LINGER_THRESHOLD:
            # Rows are flowing. Sleeping now would make every writer NOTIFY until the next
            # wake, and under steady load that is most of the time (bench/trigger.py, case d).
            # Look again shortly instead; sleep only after a drain that found only a few rows.
            self.pause(self.BUSY_LINGER)
            return
        self.sleep_until_work()

    def sample_gauges(self, store: Store | None = None) -> None:
        """Sample the gauges now and then: to metrics (when on), and for the dead-rows warning.

        `store`: a claim connection with no claim open (the main one by default).
        """
        metrics_on = not isinstance(self.metrics, NullMetrics)
        now = self.clock.monotonic()
        if now < self.next_gauges:
            return
        self.next_gauges = now + (self.GAUGE_INTERVAL if metrics_on else self.VACUUM_CHECK_INTERVAL)
        try:
            gauges = (store or self.store).queue_gauges()
        except GaugeUnavailable as exc:
            # The connection is fine: report it and try again next interval, nothing more.
            log.warning("outbox.gauges_failed", error=str(exc))
            return
        if metrics_on:
            self.metrics.queue(gauges.depth, gauges.oldest_seconds)
            holder = gauges.holder
            self.metrics.vacuum(gauges.dead_rows, (holder.seconds or 0.0) if holder else 0.0)
        self.warn_if_vacuum_held_back(gauges)

    def warn_if_vacuum_held_back(self, gauges: QueueGauges) -> None:
        """outbox.vacuum_held_back when the dead rows pass DEAD_ROWS_WARNING (rate-limited)."""
        now = self.clock.monotonic()
        if gauges.dead_rows < self.DEAD_ROWS_WARNING or now < self.next_vacuum_warning:
            return
        self.next_vacuum_warning = now + self.VACUUM_WARNING_INTERVAL
        holder = gauges.holder
        log.warning(
            "outbox.vacuum_held_back",
            dead_rows=gauges.dead_rows,
            holder=holder.kind if holder else None,
            holder_pid=holder.pid if holder else None,
            holder_name=holder.name if holder else None,
            holder_seconds=round(holder.seconds, 1) if holder and holder.seconds else None,
            holder_xids=holder.xids if holder else None,
        )

    def drain(self) -> bool:
        """Process batches until one comes back short; False when the broker is down.

        `self.drained` tells how many rows this drain claimed.
        """
        self.drained = 0
        if self.spare_store is not None and overlaps(self.publisher):
            return self.drain_overlapped(self.spare_store)
        return self.batches.run()

    def drain_overlapped(self, spare: Store) -> bool:
        """drain() with two batches in flight: claim and write the next batch on the other
        claim connection while the broker confirms the previous one, then finalise that.

        While a batch is in flight nothing may make its claim outlive --stale-timeout: the
        next batch is started only when the publisher needs no reconnect (can_overlap), when
        the previous claim has a step's worst case left, and when it makes no result-backend
        calls; its broker steps must end within the previous claim's budget too. Batches
        commit in the order they were claimed. A database failure on one connection still
        lets the batch in flight on the other finish.
        """
        stores = (self.store, spare)
        turn = 0
        previous: _InFlight | None = None
        current: _InFlight | None = None
        try:
            while not self.stopping and (previous is None or previous.full):
                if previous is not None:
                    claimed = self.claim_beside(stores[turn], previous)
                    if claimed is _Finalise.FIRST:
                        done, previous = previous, None
                        if self.end_in_flight(done):
                            return False
                        continue
                    current = claimed
                else:
                    try:
                        current = self.claim_alone(stores[turn])
                    except BrokerUnavailable as exc:
                        self._record_outage(0, str(exc))
                        return False
                if current is None:
                    break
                turn ^= 1
                both, previous, current = (previous, current), None, None  # advance() owns them
                previous = self.advance(*both)
                if previous is None:
                    return False  # a broker outage ended both batches
            if previous is not None:
                done, previous = previous, None
                return not self.end_in_flight(done)
            return True
        except BaseException as exc:
            self.abort_in_flight(exc, previous, current)
            raise

    def claim_alone(self, store: Store) -> _InFlight | None:
        """Claim with no batch in flight: gauges, the broker check (BrokerUnavailable), then
        the claim; None when nothing is claimable."""
        self.touch_liveness()
        self.sample_gauges(store)  # never beside a claim: it could queue behind a lock request
        self.publisher.check()  # connect before claiming
        return self.claim_in_flight(store)

    def claim_beside(self, store: Store, previous: _InFlight) -> _InFlight | _Finalise | None:
        """Claim the next batch while `previous` is in flight, or say it must be finalised
        first (_Finalise.FIRST): no room in its claim, a reconnect needed, or the table
        locked for someone queued behind it."""
        self.touch_liveness()
        if not self.may_overlap(previous):
            return _Finalise.FIRST
        try:
            return self.claim_in_flight(store, lock_wait=self.OVERLAP_LOCK_WAIT)
        except ClaimWouldWait:
            log.info("outbox.claim_would_wait", waited=self.OVERLAP_LOCK_WAIT)
            return _Finalise.FIRST

    def advance(self, previous: _InFlight | None, current: _InFlight) -> _InFlight | None:
        """Start `current` and finalise `previous` (first, when `current` makes result-backend
        calls: they have no deadline of their own, so never beside a claim). The batch now in
        flight, or None after a broker outage (both ended). Ends what is open if it raises."""
        left = [batch for batch in (previous, current) if batch is not None]  # still open
        try:
            if previous is not None and current.backend_calls:
                left.remove(previous)
                if self.end_in_flight(previous):
                    left.remove(current)
                    current.claiming.__exit__(None, None, None)  # released untouched
                    return None
                previous = None
            self.start_in_flight(current, None if previous is None else previous.claim_end)
            if previous is not None:
                left.remove(previous)
                if self.end_in_flight(previous):
                    left.remove(current)
                    self.end_in_flight(current, breaker=False)
                    return None
            return current
        except BaseException as exc:
            self.abort_in_flight(exc, *left)
            raise

    def may_overlap(self, previous: _InFlight) -> bool:
        """Whether the next batch may be started while `previous` awaits its outcome."""
        left = previous.claim_end - self.clock.monotonic()
        return left >= self.config.step_worst_case and can_overlap(self.publisher)

    def claim_in_flight(self, store: Store, lock_wait: float | None = None) -> _InFlight | None:
        """Claim a batch and prepare its messages; None when nothing was claimable."""
        started = self.clock.monotonic()
        claiming = store.claim(self.config.batch_size, lock_wait=lock_wait)
        claim = claiming.__enter__()
        try:
            if not claim.rows:
                claiming.__exit__(None, None, None)
                return None
            ready, undecodable = self.prepare(claim.rows)
        except BaseException:
            if not claiming.__exit__(*sys.exc_info()):
                raise
            raise  # pragma: no cover - a claim never swallows an exception
        return _InFlight(
            claiming=claiming,
            claim=claim,
            ready=ready,
            undecodable=undecodable,
            started=started,
            claim_end=started + self.config.publish_budget,
            full=len(claim.rows) >= self.config.batch_size,
        )

    def start_in_flight(self, batch: _InFlight, before: float | None) -> None:
        """Start publishing a claimed batch; its broker steps end by `before` too, if given."""
        end = batch.claim_end if before is None else min(batch.claim_end, before)
        batch.pending = start(self.publisher, batch.ready, self.deadline(end))

    def end_in_flight(self, batch: _InFlight, *, breaker: bool = True) -> bool:
        """Await a started batch's outcome, finalise and commit it; True on a broker outage."""
        try:
            attempts = batch.pending.wait() if batch.pending is not None else []
            decided = self.policy.decide(
                list(zip((m.row for m in batch.ready), attempts, strict=True)), batch.undecodable
            )
            batch.claim.finish(decided.outcome)
        except BaseException:
            if not batch.claiming.__exit__(*sys.exc_info()):
                raise
            raise  # pragma: no cover - a claim never swallows an exception
        batch.claiming.__exit__(None, None, None)
        claimed = len(batch.claim.rows)
        self.drained += claimed
        self.after_commit(decided, claimed, self.clock.monotonic() - batch.started, breaker=breaker)
        return decided.outages > 0

    def abort_in_flight(self, exc: BaseException, *batches: _InFlight | None) -> None:
        """End what is still open after an exception: a batch whose publishing started is
        still finalised on its own connection when the failure was another connection's;
        anything else is rolled back (its rows released untouched)."""
        for batch in batches:
            if batch is None:
                continue
            if isinstance(exc, DatabaseUnavailable) and batch.pending is not None:
                with contextlib.suppress(DatabaseUnavailable):
                    self.end_in_flight(batch, breaker=False)  # ends its claim either way
                continue
            if batch.pending is not None:
                batch.pending.cancel()
            with contextlib.suppress(Exception):
                batch.claiming.__exit__(type(exc), exc, exc.__traceback__)

    # -- sleeping (relay/_sleeper.py) ----------------------------------------------------

    def sleep_until_work(self) -> None:
        """Block until something may be claimable (see the module docstring)."""
        self.sleeper.sleep_until_work()

    def peek(self) -> Peek:
        """One indexed look at the table: on the LISTEN connection when there is one."""
        return self.sleeper.peek()

    def wait(self, timeout: float) -> Wake:
        """Wait in slices so the liveness file stays fresh while blocked."""
        return self.sleeper.wait(timeout)

    def pause(self, seconds: float) -> Wake:
        """Sleep without a database connection, waking early on a stop signal."""
        return self.sleeper.pause(seconds)

    # -- one batch (relay/_drain.py) ------------------------------------------------------

    def process_batch(self) -> tuple[int, bool]:
        """Claim, publish, finalise one batch; return (rows claimed, broker outage?)."""
        return self.batches.process_batch()

    def prepare(self, rows: list[ClaimedRow]) -> Prepared:
        """The rows' messages, and the rows that cannot become one (with the reason)."""
        return self.batches.prepare(rows)

    def deadline(self, claim_end: float) -> PublishDeadline:
        """When broker steps may no longer start: `claim_end`, or a stop's grace period."""
        return self.batches.deadline(claim_end)

    def after_commit(
        self, decided: Decided, claimed: int, seconds: float, *, breaker: bool = True
    ) -> None:
        """Reporters and the breaker, once the outcome committed (see BatchDrain)."""
        self.batches.after_commit(decided, claimed, seconds, breaker=breaker)

    def _record_outage(self, deferred: int, error: str | None) -> None:
        self.batches.record_outage(deferred, error)

    # -- liveness ------------------------------------------------------------------------

    def touch_liveness(self) -> None:
        """Update the liveness file's mtime (a probe checks that it is recent), at most 1/s."""
        path: Path | None = self.config.liveness_file
        now = self.clock.monotonic()
        if path is None or now < self.next_touch:
            return
        self.next_touch = now + self.LIVENESS_MIN_INTERVAL
        try:
            path.touch()
        except OSError as exc:
            log.warning("outbox.liveness_file_error", path=str(path), error=str(exc))
