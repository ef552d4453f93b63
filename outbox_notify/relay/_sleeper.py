"""The relay's sleep: block until something may be claimable (see loop.py's docstring).

Stateless: it reads the relay's seams and flags through `SleeperHost`, so a test that sets
`relay.polling` or requests a stop is seen here at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import Protocol

from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.listener import LockState, Outwait, Wake, WakeChannel
from outbox_notify.relay.store import Peek, Store
from outbox_notify.relay.timing import Clock


class SleeperHost(Protocol):
    """What the sleeper reads from the relay that owns it."""

    DUE_SLACK: float
    config: RelayConfig
    clock: Clock
    store: Store
    listener: WakeChannel | None
    polling: bool

    @property
    def stopping(self) -> bool: ...

    def touch_liveness(self) -> None: ...

    def sample_gauges(self, store: Store | None = None) -> None: ...


class Sleeper:
    """Sleeping and waking: the wake lock, outwaiting writers, timers and the stop signal."""

    def __init__(self, relay: SleeperHost) -> None:
        self.relay = relay

    def sleep_until_work(self) -> None:
        """Block until something may be claimable (see the module docstring of loop.py).

        While nothing happens, a sleeping relay keeps the wake lock across its timer wakes and
        costs one indexed peek per sweep interval.
        """
        relay = self.relay
        if relay.polling or relay.listener is None:
            self.wait(self.sleep_timeout(self.peek()))
            return
        listener = relay.listener
        # Notifications that arrived before the lock (or during the drain it was kept
        # through) are for rows the peek below will see.
        listener.drain_pending()
        if listener.holds_lock:
            state = LockState.HELD  # kept through the short drain since the last wake
        else:
            state = listener.take_lock()
            if state is LockState.WRITERS:
                state = self.outwait_writers(listener)
                if state is LockState.WRITERS:
                    return  # rows to claim, or a stop: drain again
        keep = False
        try:
            while not relay.stopping:
                relay.sample_gauges()
                peek = self.peek()
                if peek.claimable:
                    keep = state is LockState.HELD and self.may_keep_lock(listener)
                    return
                wake = self.wait(self.sleep_timeout(peek))
                # Another relay holds the lock: come back and try to take it, in case it died.
                if wake is not Wake.TIMEOUT or state is LockState.PEER:
                    keep = (
                        state is LockState.HELD
                        and wake is Wake.NOTIFIED
                        and self.may_keep_lock(listener)
                    )
                    return
        finally:
            # Woken for work, the relay keeps the lock through the drain that follows; the
            # relay lets go of it as soon as that drain turns out long (Relay.cycle). While
            # commits are this sparse, writers notify anyway, and the wake costs no release
            # and no new take: two statements less between a notification and its claim,
            # and between the end of a drain and the next sleep.
            if not keep:
                listener.release_lock()

    def may_keep_lock(self, listener: WakeChannel) -> bool:
        """Whether the lock may be kept through the drain to come: its longest batch is the
        publish budget, plus half of what --stale-timeout leaves after it for the claim and
        the finalising statements."""
        config = self.relay.config
        budget = config.publish_budget
        return listener.may_keep_lock(budget + (config.stale_timeout - budget) / 2)

    def outwait_writers(self, listener: WakeChannel) -> LockState:
        """Wait behind writers whose open transactions hold the wake lock, without spinning.

        One statement per --lock-wait: it returns at once when a row is claimable (WRITERS:
        drain), else queues for the lock, which the writers' commit hands over at once (HELD:
        sleep as usual, whose peek finds their rows). Writers arriving meanwhile see the
        queued request and notify; their notification ends the wait (WRITERS). Once per
        sweep interval it checks whether a sleeping relay took the lock instead (PEER).
        """
        relay = self.relay
        recheck_at = relay.clock.monotonic() + relay.config.sweep_interval
        while not relay.stopping:
            relay.touch_liveness()
            relay.sample_gauges()
            outcome = listener.await_writers()
            if outcome is Outwait.LOCKED:
                return LockState.HELD
            if outcome is Outwait.CLAIMABLE or listener.drain_pending():
                return LockState.WRITERS
            if relay.clock.monotonic() >= recheck_at:
                if listener.lock_holder() is LockState.PEER:
                    return LockState.PEER
                recheck_at = relay.clock.monotonic() + relay.config.sweep_interval
        return LockState.WRITERS

    def peek(self) -> Peek:
        """One indexed look at the table: on the LISTEN connection when there is one."""
        listener = self.relay.listener
        if listener is not None and listener.connected and not self.relay.polling:
            return listener.peek()
        return self.relay.store.peek()

    def sleep_timeout(self, peek: Peek) -> float:
        """Seconds to sleep: the sweep interval, or less when a retry or a held row is due."""
        config = self.relay.config
        timeout = config.sweep_interval
        if peek.next_due_in is not None:
            timeout = min(timeout, max(0.0, peek.next_due_in) + self.relay.DUE_SLACK)
        if peek.due and not peek.claimable:
            timeout = min(timeout, config.inflight_recheck)  # another relay holds rows
        return timeout

    def wait(self, timeout: float) -> Wake:
        """Wait in slices so the liveness file stays fresh while blocked."""
        relay = self.relay
        deadline = relay.clock.monotonic() + timeout
        while not relay.stopping:
            remaining = deadline - relay.clock.monotonic()
            if remaining <= 0:
                return Wake.TIMEOUT
            wake = self._wait_slice(min(remaining, relay.config.liveness_interval))
            relay.touch_liveness()
            if wake is not Wake.TIMEOUT:
                return wake
        return Wake.SIGNAL

    def _wait_slice(self, timeout: float) -> Wake:
        listener = self.relay.listener
        if listener is not None and listener.connected:
            return listener.wait(timeout)
        return self.pause(timeout)

    def pause(self, seconds: float) -> Wake:
        """Sleep without a database connection, waking early on a stop signal."""
        listener = self.relay.listener
        wake_fd = listener.wake_fd if listener is not None else None
        if wake_fd is None:
            time.sleep(min(seconds, 0.2) if self.relay.stopping else seconds)
            return Wake.TIMEOUT
        readable, _, _ = select.select([wake_fd], [], [], max(0.0, seconds))
        if readable:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                os.read(wake_fd, 512)
            return Wake.SIGNAL
        return Wake.TIMEOUT
