"""In-memory stand-ins for the relay core's seams (Store, WakeChannel, Publisher, Clock...).

Importable without Django: tests/unit/test_relay_core.py runs them in a process that has no
settings module at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from outbox_notify.exceptions import GaugeUnavailable
from outbox_notify.relay.listener import LockState, Outwait, Wake
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.store import ClaimedRow, Outcome, Peek, QueueGauges, SnapshotHolder

OPTIONS = json.dumps({"headers": {"id": "x", "task": "t"}, "exchange": "", "routing_key": "q"})


def row(n: int, retries: int = 0, options: str = OPTIONS, age: float = 0.0) -> ClaimedRow:
    """A claimed row of task `t` with id n."""
    return ClaimedRow(
        n, f"id-{n}", "t", "[]", "{}", options, "{}", retries, 1, dt.datetime.now(dt.UTC), age
    )


class FakeClock:
    """Monotonic time that moves only when a fake says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakeClaim:
    def __init__(self, rows: list[ClaimedRow]) -> None:
        self.rows = rows
        self.outcome: Outcome | None = None

    def finish(self, outcome: Outcome) -> None:
        self.outcome = outcome


class FakeStore:
    """A table of rows in memory; claims take the first `limit`."""

    def __init__(self, rows: list[ClaimedRow]) -> None:
        self.rows = rows
        self.finished: list[Outcome] = []
        self.claims = 0
        self.gauges = 0
        self.gauge_error: str | None = None
        self.dead_rows = 0
        self.holder: SnapshotHolder | None = None

    def connect(self) -> None: ...
    def close(self) -> None: ...

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[FakeClaim]:
        self.claims += 1
        claim = FakeClaim(self.rows[:limit])
        yield claim
        if claim.outcome is not None:
            self.finished.append(claim.outcome)
            gone = (
                set(claim.outcome.published)
                | {d.id for d in claim.outcome.dead}
                | {r.id for r in claim.outcome.retry}
            )
            self.rows = [r for r in self.rows if r.id not in gone]

    def peek(self) -> Peek:
        return Peek(claimable=bool(self.rows), due=bool(self.rows), next_due_in=None)

    def queue_gauges(self) -> QueueGauges:
        self.gauges += 1
        if self.gauge_error is not None:
            raise GaugeUnavailable(self.gauge_error)
        return QueueGauges(
            depth=len(self.rows), oldest_seconds=1.5, dead_rows=self.dead_rows, holder=self.holder
        )

    def send_probe(self, payload: str) -> None: ...


class ScriptedPublisher:
    """Answers each publish with results from a function of the message."""

    def __init__(self, answer: Callable[[OutgoingMessage], Attempt]) -> None:
        self.answer = answer
        self.calls = 0

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        self.calls += 1
        return [self.answer(m) for m in messages]

    def check(self) -> None: ...
    def close(self) -> None: ...


def publishes_all() -> ScriptedPublisher:
    """A publisher the broker accepts every message from."""
    return ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED))


class RecordingMetrics:
    """Records every Metrics call as (method, args)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: self.calls.append((name, args))


@dataclasses.dataclass
class FakeListener:
    """A WakeChannel whose answers are scripted; it moves the clock as the real one would.

    `take_lock` and `await_writers` pop their next answer (the last one repeats); each
    await_writers call lasts `lock_wait` unless it ends LOCKED or CLAIMABLE. `waits` are the
    outcomes of successive waits on LISTEN (TIMEOUT lasts the whole timeout). `pending`
    notifications are what drain_pending() finds next. `on_statement` runs after each
    statement, so a test can stop the relay or commit rows at a chosen moment.
    """

    clock: FakeClock
    store: FakeStore
    lock_wait: float = 0.05
    locks: list[LockState] = dataclasses.field(default_factory=lambda: [LockState.HELD])
    outwaits: list[Outwait] = dataclasses.field(default_factory=lambda: [Outwait.TIMED_OUT])
    holders: list[LockState] = dataclasses.field(default_factory=lambda: [LockState.WRITERS])
    waits: list[Wake] = dataclasses.field(default_factory=list)
    pending: int = 0
    on_statement: Callable[[str], None] | None = None
    wake_fd: int | None = None
    statements: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    holds_lock: bool = False
    released: int = 0

    @property
    def connected(self) -> bool:
        return True

    def connect(self) -> None: ...
    def probe(self, send: Callable[[str], None]) -> bool:
        return True

    def listen(self) -> None: ...
    def close(self) -> None: ...

    def _statement(self, name: str, seconds: float = 0.0) -> None:
        self.statements.append((self.clock.now, name))
        self.clock.now += seconds
        if self.on_statement is not None:
            self.on_statement(name)

    def named(self, name: str) -> int:
        """How many statements of this kind ran."""
        return sum(1 for _, n in self.statements if n == name)

    @staticmethod
    def _next(answers: list[Any]) -> Any:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def take_lock(self) -> LockState:
        state: LockState = self._next(self.locks)
        self.holds_lock = state is LockState.HELD
        self._statement("take_lock", 0.0 if state is LockState.HELD else self.lock_wait)
        return state

    def await_writers(self) -> Outwait:
        outcome: Outwait = self._next(self.outwaits)
        self.holds_lock = outcome is Outwait.LOCKED
        self._statement("await_writers", self.lock_wait if outcome is Outwait.TIMED_OUT else 0.0)
        return outcome

    def lock_holder(self) -> LockState:
        holder: LockState = self._next(self.holders)
        self._statement("lock_holder")
        return holder

    def release_lock(self) -> None:
        if self.holds_lock:
            self.released += 1
            self.holds_lock = False
            self._statement("release_lock")

    def peek(self) -> Peek:
        self._statement("peek")
        return self.store.peek()

    def drain_pending(self) -> int:
        found, self.pending = self.pending, 0
        return found

    def wait(self, timeout: float) -> Wake:
        wake = self.waits.pop(0) if self.waits else Wake.TIMEOUT
        self.clock.now += timeout if wake is Wake.TIMEOUT else 0.0
        return wake
