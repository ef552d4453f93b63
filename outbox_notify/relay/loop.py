"""The relay loop: drain, sleep until woken, repeat. Orchestration only.

drain:  claim a batch (row locks in an open transaction), publish it, finalise it in
        one round trip and commit; repeat until a batch comes back short. With a publisher
        that can have two batches in flight (RabbitMQ's confirms) and a second claim
        connection, the next batch is claimed and written while the broker confirms the
        previous one (relay/_overlap.py).
sleep:  take the wake lock (writers notify from now on), peek once more for work that
        committed before the lock, then block on LISTEN until a notification, the next
        retry's due time, the sweep timer, or a signal.
outwait: when writers' open transactions hold the wake lock, queue for it one --lock-wait
        at a time (one statement each) instead of draining again: their commit hands the
        lock over at once, and a claimable row or another writer's notification ends it.

Relay here is the lifecycle (connect, cycle, stop, gauges, liveness) and composes the rest:
BatchDrain (_drain.py), OverlappedDrain (_overlap.py) and Sleeper (_sleeper.py: sleep and
outwait).

The core imports nothing from Django: runner.py builds its seams (Store, WakeChannel,
Publisher, Metrics, Reporter) from the settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog

from outbox_notify.exceptions import (
    DatabaseUnavailable,
    GaugeUnavailable,
)
from outbox_notify.metrics import Metrics, NullMetrics
from outbox_notify.relay._drain import BatchDrain
from outbox_notify.relay._overlap import OverlappedDrain
from outbox_notify.relay._sleeper import Sleeper
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.listener import Wake, WakeChannel
from outbox_notify.relay.outcome import OutcomePolicy
from outbox_notify.relay.publisher import (
    Publisher,
    overlaps,
)
from outbox_notify.relay.reporting import (
    LogReporter,
    MetricsReporter,
    Reporter,
    Reporters,
)
from outbox_notify.relay.samples import SampleRecorder, SampleSink
from outbox_notify.relay.store import (
    Peek,
    QueueGauges,
    Store,
)
from outbox_notify.relay.timing import Backoff, Breaker, Clock, SystemClock

log = structlog.get_logger("outbox_notify")


class Relay:
    """One relay process: owns a claim store, a listener (unless polling) and a publisher."""

    RECONNECT_BASE = 0.1  # seconds
    RECONNECT_CAP = 10.0  # seconds
    DUE_SLACK = 0.001  # seconds added to a retry's due time so it is due when we wake
    GAUGE_INTERVAL = 15.0  # seconds between gauge samples with metrics on
    # Seconds between gauge samples with metrics off: only the dead-rows warning reads them.
    VACUUM_CHECK_INTERVAL = 60.0
    # Dead rows a snapshot holds back (QueueGauges.dead_rows_held) past which the relay warns
    # (outbox.vacuum_held_back), at most once per VACUUM_WARNING_INTERVAL seconds: claims do
    # not slow down, but the table grows.
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
        samples: SampleSink | None = None,
    ) -> None:
        self.config = config
        self.store = store
        # A second claim connection, used only to claim the next batch while the previous one
        # awaits its confirms (a publisher that overlaps batches): see relay/_overlap.py.
        self.spare_store = spare_store
        self.listener = listener
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.metrics = metrics or NullMetrics()
        # The admin dashboard's rows (relay/samples.py), written when the gauges are read.
        self.sampler = None
        if samples is not None:
            self.sampler = SampleRecorder(samples, now=self.clock.monotonic())
            reporters = [*reporters, self.sampler]
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
        self.overlapped = OverlappedDrain(self, self.batches)
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
                self.store.session_proven()
                if self.spare_store is not None:
                    self.spare_store.session_proven()
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
            self.let_go_of_wake_lock()
            self.pause(min(cooldown, self.config.liveness_interval))
            return
        if not self.drain() or self.stopping:
            self.let_go_of_wake_lock()
            return
        self.sample_gauges()
        if self.drained >= self.LINGER_THRESHOLD:
            # Rows are flowing. Sleeping now would make every writer NOTIFY until the next
            # wake, and under steady load that is most of the time (bench/trigger.py, case d).
            # Look again shortly instead; sleep only after a drain that found only a few rows.
            self.let_go_of_wake_lock()
            self.pause(self.BUSY_LINGER)
            return
        self.sleep_until_work()

    def let_go_of_wake_lock(self) -> None:
        """Release the wake lock if a wake kept it (see Sleeper.sleep_until_work): writers
        stop notifying while the relay is busy, paused or cooling down."""
        if self.listener is not None and self.listener.connected:
            self.listener.release_lock()

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
            self.metrics.vacuum(
                gauges.dead_rows,
                (holder.seconds or 0.0) if holder else 0.0,
                gauges.dead_rows_held,
            )
            # Read by the same statement as the depth, as fresh (GAUGE_INTERVAL), so due =
            # depth - held - retrying adds up; no query per batch.
            self.metrics.backlog(gauges.due, gauges.held, gauges.retrying, gauges.dead_letters)
            self.metrics.relays(gauges.relays_listening)
        self.warn_if_vacuum_held_back(gauges)
        self.record_sample(gauges, now)

    def record_sample(self, gauges: QueueGauges, now: float) -> None:
        """Write the dashboard's row for this relay when its interval has passed."""
        if self.sampler is None or not self.sampler.due(now):
            return
        try:
            self.sampler.write(now, depth=gauges.depth, polling=self.polling)
        except GaugeUnavailable as exc:
            log.warning("outbox.sample_failed", error=str(exc))

    def warn_if_vacuum_held_back(self, gauges: QueueGauges) -> None:
        """outbox.vacuum_held_back when the dead rows a snapshot holds back pass
        DEAD_ROWS_WARNING (rate-limited). Dead rows that only wait for autovacuum's next round
        do not count: a busy outbox deletes more than that between two rounds."""
        now = self.clock.monotonic()
        if gauges.dead_rows_held < self.DEAD_ROWS_WARNING or now < self.next_vacuum_warning:
            return
        self.next_vacuum_warning = now + self.VACUUM_WARNING_INTERVAL
        holder = gauges.holder
        log.warning(
            "outbox.vacuum_held_back",
            dead_rows=gauges.dead_rows,
            dead_rows_held=gauges.dead_rows_held,
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
            self.let_go_of_wake_lock()  # batches overlap: a drain here is never short
            return self.overlapped.run(self.spare_store)
        return self.batches.run()

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
