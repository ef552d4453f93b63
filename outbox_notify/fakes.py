"""In-memory stand-ins for the relay's seams, for unit tests without PostgreSQL or a broker.

`InMemoryStore` (the claim side), `FakeListener` (the LISTEN side), `ScriptedPublisher` and
`FakeClock` plug into `outbox_notify.relay.loop.Relay` in place of the real ones. Importing
this module needs no Django settings and imports none of the Django glue, so the relay core
runs on them in a plain process. The in-memory store runs one method per named query of
`sql/queries.sql` that the real store runs (`query_claim_batch` for `claim_batch`, ...), and
a test keeps the two lists equal.

They stand beside PostgreSQL, never for it: LISTEN/NOTIFY, SKIP LOCKED and transaction
visibility are only tested against a real server.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from outbox_notify.exceptions import GaugeUnavailable
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.listener import LockState, Outwait, Wake
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.store import (
    ClaimedRow,
    Outcome,
    Peek,
    QueueGauges,
    Sample,
    SnapshotHolder,
    finalize_params,
    gauge_params,
    sample_params,
)
from outbox_notify.serialization import SCHEMA_VERSION

__all__ = [
    "OPTIONS",
    "FakeClock",
    "FakeListener",
    "InMemoryClaim",
    "InMemoryStore",
    "RecordingMetrics",
    "ScriptedPublisher",
    "claimed_row",
    "publishes_all",
]

# The stored options of a plain task sent to the default exchange, routing key "q".
OPTIONS = json.dumps({"headers": {"id": "x", "task": "t"}, "exchange": "", "routing_key": "q"})


def claimed_row(
    n: int, retries: int = 0, options: str = OPTIONS, age: float = 0.0, task_name: str = "t"
) -> ClaimedRow:
    """A claimed row with id n, task id `id-{n}`, no arguments, created now."""
    return ClaimedRow(
        n, f"id-{n}", task_name, "[]", "{}", options, "{}", retries, 1, dt.datetime.now(dt.UTC), age
    )


class FakeClock:
    """Monotonic time that moves only when told (`clock.now += seconds`)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        """The time the test set."""
        return self.now


class InMemoryClaim:
    """The rows of one open claim; the outcome is applied when the claim block ends."""

    def __init__(self, rows: list[ClaimedRow]) -> None:
        self.rows = rows
        self.outcome: Outcome | None = None

    def finish(self, outcome: Outcome) -> None:
        """Keep the outcome, as the real claim commits it."""
        self.outcome = outcome


class InMemoryStore:
    """The relay's claim store over a list of rows; claims take the first `limit`.

    Each Store method runs the named queries the real store (relay/store.py) runs, through
    `run(name, params)`, which calls `query_<name>` with the same parameters. `ran` lists the
    queries in order; `finished` the outcome of every claim. Rows are never held back for a
    retry time: a test that wants a row later adds it later. Set `gauge_error` to make the
    gauges fail as a missing permission does; `dead_rows`, `dead_rows_held`, `dead_letters`
    and `holder` are what they report.
    """

    def __init__(self, rows: Iterable[ClaimedRow] = ()) -> None:
        self.rows = list(rows)
        self.ran: list[str] = []
        self.finished: list[Outcome] = []
        self.claims = 0
        self.gauges = 0
        self.gauge_error: str | None = None
        self.dead_rows = 0
        self.dead_rows_held = 0
        self.dead_letters = 0  # what the dead-letter gauge counts
        self.holder: SnapshotHolder | None = None
        self.probes: list[str] = []
        self.proven = False  # session_proven() was called
        self.frontier: Any = None  # the state save_frontier stored last
        self.samples: list[dict[str, Any]] = []  # record_sample's parameters, in order

    def run(self, name: str, params: Mapping[str, Any] | None = None) -> Any:
        """Run the in-memory twin of the named query."""
        self.ran.append(name)
        handler: Callable[..., Any] = getattr(self, f"query_{name}")
        return handler(**(params or {}))

    # -- the Store protocol ----------------------------------------------------------------

    def connect(self) -> None:
        """Load the saved frontier, as the real store does on connecting."""
        version = {"max_version": SCHEMA_VERSION}
        self.run("set_claim_timeout", {"timeout_ms": "30000"})
        self.run("ensure_frontier_row", version)
        self.run("restamp_copied_rows", {"limit": 5_000})
        self.run("load_frontier", version)
        self.run("cluster_identity")

    def close(self) -> None:
        """Save the frontier, as the real store does on closing."""
        self.run("save_frontier", {"state": self.frontier, "max_version": SCHEMA_VERSION})

    @contextlib.contextmanager
    def claim(self, limit: int, *, lock_wait: float | None = None) -> Iterator[InMemoryClaim]:
        """Claim the first `limit` rows; the claim's outcome applies when the block ends."""
        self.claims += 1
        self.run("set_claim_timeout", {"timeout_ms": "0"})
        if lock_wait is not None:
            self.run("set_claim_lock_wait", {"wait": str(max(1, int(lock_wait * 1000)))})
        params = {**Frontier().params(), "limit": limit, "max_version": SCHEMA_VERSION}
        claim = InMemoryClaim(self.run("claim_batch", params))
        if lock_wait is not None:
            self.run("reset_claim_lock_wait")
            self.run("reset_claim_statement_timeout")
        yield claim
        if claim.outcome is not None:
            self.finished.append(claim.outcome)
            self._finish(claim.outcome)

    def _finish(self, outcome: Outcome) -> None:
        if outcome.retry or outcome.dead:
            self.run("finalize_batch", finalize_params(outcome))
        elif outcome.published:
            self.run("delete_published", {"ids": list(outcome.published)})

    def peek(self) -> Peek:
        """Whether any row is there to claim (every row is due)."""
        self.run("set_claim_timeout", {"timeout_ms": "0"})
        params = {**Frontier().params(), "max_version": SCHEMA_VERSION}
        claimable, due, next_due_in = self.run("peek", params)
        return Peek(claimable=claimable, due=due, next_due_in=next_due_in)

    def queue_gauges(self) -> QueueGauges:
        """The depth is the number of rows; the oldest is 1.5 seconds old."""
        self.gauges += 1
        self.run("set_claim_timeout", {"timeout_ms": "0"})
        params = {**Frontier().params(with_held=True), **gauge_params()}
        gauges: QueueGauges = self.run("queue_gauges", params)
        if self.run("dead_letters_readable"):
            letters: int = self.run("count_dead_letters", {"limit": params["limit"]})
            gauges = dataclasses.replace(gauges, dead_letters=letters)
        return gauges

    def send_probe(self, payload: str) -> None:
        """Keep the payload in `probes`."""
        self.run("notify_probe", {"payload": payload})

    def session_proven(self) -> None:
        """Note that the LISTEN probe went through (the real store turns on prepared
        statements)."""
        self.proven = True

    def record_sample(self, sample: Sample) -> None:
        """Keep the sample's parameters in `samples` (fails like the gauges with
        `gauge_error`)."""
        self.run("record_sample", sample_params(sample))

    # -- the named queries: parameters as in sql/queries.sql, `frontier` for Frontier.params()

    def query_ensure_frontier_row(self, *, max_version: int) -> None: ...

    def query_load_frontier(self, *, max_version: int) -> Any:
        return self.frontier

    def query_restamp_copied_rows(self, *, limit: int) -> tuple[int, int]:
        return (0, 0)

    def query_cluster_identity(self) -> str:
        return "in-memory/00000001"

    def query_save_frontier(self, *, state: Any, max_version: int) -> None:
        self.frontier = state

    def query_set_claim_timeout(self, *, timeout_ms: str) -> None: ...
    def query_set_claim_lock_wait(self, *, wait: str) -> None: ...
    def query_reset_claim_lock_wait(self) -> None: ...
    def query_reset_claim_statement_timeout(self) -> None: ...

    def query_claim_batch(
        self, *, limit: int, max_version: int, **frontier: Any
    ) -> list[ClaimedRow]:
        return self.rows[:limit]

    def query_finalize_batch(
        self,
        *,
        published: list[int],
        retry_ids: list[int],
        retry_counts: list[int],
        retry_delays: list[float],
        retry_errors: list[str],
        dead_ids: list[int],
        dead_counts: list[int],
        dead_reasons: list[str],
    ) -> None:
        self._remove({*published, *retry_ids, *dead_ids})

    def query_delete_published(self, *, ids: list[int]) -> None:
        self._remove(set(ids))

    def _remove(self, gone: set[int]) -> None:
        self.rows = [r for r in self.rows if r.id not in gone]

    def query_peek(self, *, max_version: int, **frontier: Any) -> tuple[bool, bool, None]:
        return bool(self.rows), bool(self.rows), None

    def query_queue_gauges(self, *, limit: int, window: int, **frontier: Any) -> QueueGauges:
        if self.gauge_error is not None:
            raise GaugeUnavailable(self.gauge_error)
        return QueueGauges(
            depth=len(self.rows),
            oldest_seconds=1.5,
            dead_rows=self.dead_rows,
            dead_rows_held=self.dead_rows_held,
            holder=self.holder,
        )

    def query_dead_letters_readable(self) -> bool:
        return True

    def query_count_dead_letters(self, *, limit: int) -> int:
        return min(self.dead_letters, limit)

    def query_notify_probe(self, *, payload: str) -> None:
        self.probes.append(payload)

    def query_record_sample(
        self,
        *,
        relay: str,
        host: str,
        pid: int,
        mode: str,
        seconds: float,
        published: int,
        retried: int,
        dead_lettered: int,
        deferred: int,
        lag_p50_ms: float | None,
        lag_p99_ms: float | None,
        depth: int,
        dead_by_task: Any,
        limit: int,
        keep_seconds: float,
    ) -> None:
        if self.gauge_error is not None:
            raise GaugeUnavailable(self.gauge_error)
        self.samples.append(
            {
                "relay": relay,
                "host": host,
                "pid": pid,
                "mode": mode,
                "seconds": seconds,
                "published": published,
                "retried": retried,
                "dead_lettered": dead_lettered,
                "deferred": deferred,
                "lag_p50_ms": lag_p50_ms,
                "lag_p99_ms": lag_p99_ms,
                "depth": depth,
                "dead_by_task": dict(dead_by_task.obj),
            }
        )


class ScriptedPublisher:
    """A Publisher answering each message with a function of it (`Attempt(Result.X)`)."""

    def __init__(self, answer: Callable[[OutgoingMessage], Attempt]) -> None:
        self.answer = answer
        self.calls = 0
        self.messages: list[OutgoingMessage] = []

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Answer every message of the batch."""
        self.calls += 1
        self.messages.extend(messages)
        return [self.answer(m) for m in messages]

    def check(self) -> None:
        """Always reachable."""

    def close(self) -> None:
        """Nothing to close."""


def publishes_all() -> ScriptedPublisher:
    """A publisher the broker accepts every message from."""
    return ScriptedPublisher(lambda m: Attempt(Result.PUBLISHED))


class RecordingMetrics:
    """Metrics that record every call as (method, args)."""

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
    statement, so a test can stop the relay or commit rows at a chosen moment. `ran` lists
    the named queries the real listener would have run (their `_bounded` variants while
    `bounded`, as on PostgreSQL 14+).
    """

    clock: FakeClock
    store: InMemoryStore
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
    bounded: bool = True
    stale_timeout: float = 30.0
    last_statement: float = 0.0
    ran: list[str] = dataclasses.field(default_factory=list)

    @property
    def connected(self) -> bool:
        """Always connected."""
        return True

    def connect(self) -> None:
        """Nothing to open."""

    def probe(self, send: Callable[[str], None]) -> bool:
        """LISTEN always works: the probe's notification is sent through `send`."""
        self.ran.append("listen_probe")
        send("probe")
        self.ran.append("unlisten_probe")
        return True

    def listen(self) -> None:
        """Nothing to listen on."""
        self.ran.extend(("listen", "set_lock_timeout", "set_listen_plan"))

    def _variant(self, name: str) -> str:
        return f"{name}_bounded" if self.bounded else name

    def close(self) -> None:
        """Nothing to close."""

    def _statement(self, name: str, seconds: float = 0.0) -> None:
        self.statements.append((self.clock.now, name))
        self.clock.now += seconds
        self.last_statement = self.clock.now
        if self.on_statement is not None:
            self.on_statement(name)

    def named(self, name: str) -> int:
        """How many statements of this kind ran."""
        return sum(1 for _, n in self.statements if n == name)

    @staticmethod
    def _next(answers: list[Any]) -> Any:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def take_lock(self) -> LockState:
        """The next scripted answer of `locks`."""
        state: LockState = self._next(self.locks)
        self.ran.append(self._variant("take_wake_lock"))
        if state is not LockState.HELD:
            self.ran.append("wake_lock_holder")
        self.holds_lock = state is LockState.HELD
        self._statement("take_lock", 0.0 if state is LockState.HELD else self.lock_wait)
        return state

    def await_writers(self) -> Outwait:
        """The next scripted answer of `outwaits`."""
        outcome: Outwait = self._next(self.outwaits)
        self.ran.append(self._variant("await_wake_lock"))
        self.holds_lock = outcome is Outwait.LOCKED
        self._statement("await_writers", self.lock_wait if outcome is Outwait.TIMED_OUT else 0.0)
        return outcome

    def lock_holder(self) -> LockState:
        """The next scripted answer of `holders`."""
        holder: LockState = self._next(self.holders)
        self.ran.append("wake_lock_holder")
        self._statement("lock_holder")
        return holder

    def release_lock(self) -> None:
        """Let go of the lock if held."""
        if self.holds_lock:
            self.released += 1
            self.ran.append(self._variant("release_wake_lock"))
            self.holds_lock = False
            self._statement("release_lock")

    def peek(self) -> Peek:
        """The peek query on the store's rows."""
        self.ran.append("peek")
        self._statement("peek")
        params = {**Frontier().params(), "max_version": SCHEMA_VERSION}
        claimable, due, next_due_in = self.store.query_peek(**params)
        return Peek(claimable=claimable, due=due, next_due_in=next_due_in)

    def may_keep_lock(self, silent_for: float) -> bool:
        """As the real one, on the fake clock: unbounded, or silent long enough to be safe."""
        if not self.bounded:
            return True
        return self.clock.now - self.last_statement + silent_for < self.stale_timeout

    def drain_pending(self) -> int:
        """The scripted `pending` count, once."""
        found, self.pending = self.pending, 0
        return found

    def wait(self, timeout: float) -> Wake:
        """The next scripted wake (TIMEOUT when none is left)."""
        wake = self.waits.pop(0) if self.waits else Wake.TIMEOUT
        self.clock.now += timeout if wake is Wake.TIMEOUT else 0.0
        return wake
