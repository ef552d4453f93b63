"""The relay's overlapped drain: the next batch is claimed and written on a second claim
connection while the broker confirms the previous one (a publisher that overlaps batches).

Each batch in flight owns its open claim through an ExitStack: entered once when claimed,
closed once when finalised, released or aborted, whichever comes first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Protocol

import structlog

from outbox_notify.exceptions import BrokerUnavailable, DatabaseUnavailable
from outbox_notify.relay import messages
from outbox_notify.relay._drain import BatchDrain
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.outcome import OutcomePolicy
from outbox_notify.relay.publisher import Pending, Publisher, can_overlap, start
from outbox_notify.relay.store import ClaimedRow, ClaimWouldWait, OpenClaim, Store
from outbox_notify.relay.timing import Clock

log = structlog.get_logger("outbox_notify")


@dataclasses.dataclass(eq=False)
class _InFlight:
    """A claimed batch written to the broker, its outcome still to come."""

    stack: contextlib.ExitStack  # holds its open claim until it is finalised or released
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


class OverlapHost(Protocol):
    """What the overlapped drain reads from the relay that owns it (and `drained`)."""

    OVERLAP_LOCK_WAIT: float
    config: RelayConfig
    clock: Clock
    store: Store
    publisher: Publisher
    policy: OutcomePolicy
    drained: int

    @property
    def stopping(self) -> bool: ...

    def touch_liveness(self) -> None: ...

    def sample_gauges(self, store: Store | None = None) -> None: ...


class OverlappedDrain:
    """drain() with two batches in flight, on two claim connections taken in turn."""

    def __init__(self, relay: OverlapHost, batches: BatchDrain) -> None:
        self.relay = relay
        self.batches = batches

    def run(self, spare: Store) -> bool:
        """drain() with two batches in flight: claim and write the next batch on the other
        claim connection while the broker confirms the previous one, then finalise that.

        While a batch is in flight nothing may make its claim outlive --stale-timeout: the
        next batch is started only when the publisher needs no reconnect (can_overlap), when
        the previous claim has a step's worst case left, and when it makes no result-backend
        calls; its broker steps must end within the previous claim's budget too. Batches
        commit in the order they were claimed. A database failure on one connection still
        lets the batch in flight on the other finish.
        """
        stores = (self.relay.store, spare)
        turn = 0
        previous: _InFlight | None = None
        current: _InFlight | None = None
        try:
            while not self.relay.stopping and (previous is None or previous.full):
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
                        self.batches.record_outage(0, str(exc))
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
        self.relay.touch_liveness()
        self.relay.sample_gauges(store)  # never beside a claim: it could queue behind a lock
        self.relay.publisher.check()  # connect before claiming
        return self.claim_in_flight(store)

    def claim_beside(self, store: Store, previous: _InFlight) -> _InFlight | _Finalise | None:
        """Claim the next batch while `previous` is in flight, or say it must be finalised
        first (_Finalise.FIRST): no room in its claim, a reconnect needed, or the table
        locked for someone queued behind it."""
        self.relay.touch_liveness()
        if not self.may_overlap(previous):
            return _Finalise.FIRST
        lock_wait = self.relay.OVERLAP_LOCK_WAIT
        try:
            return self.claim_in_flight(store, lock_wait=lock_wait)
        except ClaimWouldWait:
            log.info("outbox.claim_would_wait", waited=lock_wait)
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
                    current.stack.close()  # released untouched
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
        left = previous.claim_end - self.relay.clock.monotonic()
        return left >= self.relay.config.step_worst_case and can_overlap(self.relay.publisher)

    def claim_in_flight(self, store: Store, lock_wait: float | None = None) -> _InFlight | None:
        """Claim a batch and prepare its messages; None when nothing was claimable."""
        config = self.relay.config
        started = self.relay.clock.monotonic()
        with contextlib.ExitStack() as stack:
            claim = stack.enter_context(store.claim(config.batch_size, lock_wait=lock_wait))
            if not claim.rows:
                return None  # released untouched
            ready, undecodable = self.batches.prepare(claim.rows)
            return _InFlight(
                stack=stack.pop_all(),  # the batch owns its claim from here
                claim=claim,
                ready=ready,
                undecodable=undecodable,
                started=started,
                claim_end=started + config.publish_budget,
                full=len(claim.rows) >= config.batch_size,
            )

    def start_in_flight(self, batch: _InFlight, before: float | None) -> None:
        """Start publishing a claimed batch; its broker steps end by `before` too, if given."""
        end = batch.claim_end if before is None else min(batch.claim_end, before)
        batch.pending = start(self.relay.publisher, batch.ready, self.batches.deadline(end))

    def end_in_flight(self, batch: _InFlight, *, breaker: bool = True) -> bool:
        """Await a started batch's outcome, finalise and commit it; True on a broker outage."""
        with batch.stack:  # commits, or rolls back on an exception
            attempts = batch.pending.wait() if batch.pending is not None else []
            decided = self.relay.policy.decide(
                list(zip((m.row for m in batch.ready), attempts, strict=True)), batch.undecodable
            )
            batch.claim.finish(decided.outcome)
        claimed = len(batch.claim.rows)
        self.relay.drained += claimed
        seconds = self.relay.clock.monotonic() - batch.started
        self.batches.after_commit(decided, claimed, seconds, breaker=breaker)
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
                # Close its stack with the exception, so the claim rolls back; the caller
                # re-raises exc itself.
                batch.stack.__exit__(type(exc), exc, exc.__traceback__)
