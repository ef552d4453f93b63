"""The relay's plain drain: one batch at a time, claimed, published, finalised, committed.

Its helpers (prepare, deadline, after_commit, record_outage) are shared with the overlapped
drain (_overlap.py), which differs only in how many batches it has in flight.
"""

from __future__ import annotations

import datetime as dt
from typing import Protocol

import structlog

from outbox_notify.exceptions import BrokerUnavailable, UndecodableMessage
from outbox_notify.relay import messages
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.outcome import Decided, OutcomePolicy
from outbox_notify.relay.publisher import PublishDeadline, Publisher
from outbox_notify.relay.reporting import BatchReport, Reporters, lag
from outbox_notify.relay.store import ClaimedRow, Store
from outbox_notify.relay.timing import Breaker, Clock

log = structlog.get_logger("outbox_notify")

Prepared = tuple[list[messages.OutgoingMessage], list[tuple[ClaimedRow, str]]]


class DrainHost(Protocol):
    """What a drain reads from the relay that owns it (and `drained`, which it counts up)."""

    config: RelayConfig
    clock: Clock
    store: Store
    publisher: Publisher
    policy: OutcomePolicy
    breaker: Breaker
    reporters: Reporters
    stop_requested_at: float | None
    drained: int

    @property
    def stopping(self) -> bool: ...

    def touch_liveness(self) -> None: ...

    def sample_gauges(self, store: Store | None = None) -> None: ...

    def let_go_of_wake_lock(self) -> None: ...


class BatchDrain:
    """Batches one after another on the main claim connection, until one comes back short."""

    def __init__(self, relay: DrainHost) -> None:
        self.relay = relay

    def run(self) -> bool:
        """Process batches until one comes back short; False when the broker is down."""
        relay = self.relay
        while not relay.stopping:
            relay.touch_liveness()
            relay.sample_gauges()
            claimed, outage = self.process_batch()
            relay.drained += claimed
            if outage:
                return False
            if claimed < relay.config.batch_size:
                return True
            relay.let_go_of_wake_lock()  # a full batch: a backlog, not a short drain
        return True

    def process_batch(self) -> tuple[int, bool]:
        """Claim, publish, finalise one batch; return (rows claimed, broker outage?)."""
        relay = self.relay
        try:
            relay.publisher.check()  # connect before claiming: never reconnect inside a claim
        except BrokerUnavailable as exc:
            self.record_outage(0, str(exc))
            return 0, True
        started = relay.clock.monotonic()
        with relay.store.claim(relay.config.batch_size) as claim:
            if not claim.rows:
                return 0, False
            decided = self.publish(claim.rows, started)
            claim.finish(decided.outcome)
        self.after_commit(decided, len(claim.rows), relay.clock.monotonic() - started)
        return len(claim.rows), decided.outages > 0

    def publish(self, rows: list[ClaimedRow], started: float) -> Decided:
        """Prepare and publish rows; decide each row's outcome."""
        ready, undecodable = self.prepare(rows)
        deadline = self.deadline(started + self.relay.config.publish_budget)
        attempts = self.relay.publisher.publish(ready, deadline) if ready else []
        return self.relay.policy.decide(
            list(zip((m.row for m in ready), attempts, strict=True)), undecodable
        )

    def prepare(self, rows: list[ClaimedRow]) -> Prepared:
        """The rows' messages, and the rows that cannot become one (with the reason)."""
        now = dt.datetime.now(dt.UTC)
        ready: list[messages.OutgoingMessage] = []
        undecodable: list[tuple[ClaimedRow, str]] = []
        for row in rows:
            try:
                ready.append(messages.prepare(row, now))
            except UndecodableMessage as exc:
                undecodable.append((row, str(exc)))
        return ready, undecodable

    def deadline(self, claim_end: float) -> PublishDeadline:
        """When broker steps may no longer start: `claim_end`, or a stop's grace period."""
        relay = self.relay

        def stop_end() -> float | None:
            stop = relay.stop_requested_at
            return None if stop is None else stop + relay.config.shutdown_timeout

        return PublishDeadline(clock=relay.clock, claim_end=claim_end, stop_end=stop_end)

    def after_commit(
        self, decided: Decided, claimed: int, seconds: float, *, breaker: bool = True
    ) -> None:
        """Reporters (logs, metrics and runner's) and the breaker, once the outcome committed.

        `breaker=False`: a batch that was in flight when the one before it met an outage; that
        outage was counted already, and this batch proves nothing about the broker since.
        """
        report = BatchReport(
            decided=decided, claimed=claimed, seconds=seconds, lag=lag(decided, seconds)
        )
        self.relay.reporters.batch_committed(report)
        if not breaker:
            return
        if decided.outages:
            self.record_outage(decided.outages, decided.outage_error)
        elif decided.published and self.relay.breaker.record_success():
            log.info("outbox.breaker_closed")

    def record_outage(self, deferred: int, error: str | None) -> None:
        """Count a broker outage: outbox.breaker_opened when it opens the breaker."""
        relay = self.relay
        if relay.breaker.record_outage():
            log.error(
                "outbox.breaker_opened", cooldown=relay.config.broker_outage_cooldown, error=error
            )
        else:
            log.warning("outbox.broker_unavailable", deferred=deferred, error=error)
