"""After a scenario: wait for the system to drain, then count every message.

The rules (docs/reliability.md): every committed message executed at least once and its effect
applied exactly once (OnceTask), no rolled-back message ever executed, poison rows where they
belong, and nothing else left in the outbox.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from chaos import poison
from chaos.load import Tally

POLL = 0.25  # seconds between drain checks
SETTLE = 3.0  # seconds a system with only downstream losses must stay quiet to count as drained
EXECUTIONS_SQL = """
SELECT task_id, deliveries, redeliveries, extract(epoch FROM executed_at)::float8
FROM chaos_execution WHERE scenario = %s
"""
EFFECTS_SQL = "SELECT task_id, count(*) FROM chaos_effect WHERE scenario = %s GROUP BY task_id"
ORDERS_SQL = "SELECT task_id FROM chaos_order WHERE task_id = ANY(%s)"
DEAD_SQL = "SELECT task_id FROM outbox_notify_dead_letter_v1 WHERE task_id = ANY(%s)"
OUTBOX_LEFT_SQL = "SELECT count(*) FROM outbox_notify_message_v1 WHERE NOT (task_id = ANY(%s))"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Execution:
    """One task id as the ledger saw it."""

    deliveries: int
    redeliveries: int
    first_at: float


def executions(conn: psycopg.Connection[Any], scenario: str) -> dict[str, Execution]:
    """Every task id the worker executed in this scenario."""
    rows = conn.execute(EXECUTIONS_SQL, [scenario]).fetchall()
    return {
        str(task_id): Execution(deliveries=int(d), redeliveries=int(r), first_at=float(at))
        for task_id, d, r, at in rows
    }


def effects(conn: psycopg.Connection[Any], scenario: str) -> Counter[str]:
    """Effect rows per task id in this scenario (more than one would be a duplicate effect)."""
    rows = conn.execute(EFFECTS_SQL, [scenario]).fetchall()
    return Counter({str(task_id): int(n) for task_id, n in rows})


def dead_lettered(conn: psycopg.Connection[Any], task_ids: set[str]) -> set[str]:
    """Which of these task ids the relays moved to the dead letters."""
    if not task_ids:
        return set()
    return {str(r[0]) for r in conn.execute(DEAD_SQL, [list(task_ids)]).fetchall()}


def resolve_ambiguous(conn: psycopg.Connection[Any], tally: Tally) -> tuple[int, int]:
    """Settle commits whose COMMIT raised: the business row tells whether it happened."""
    ids = list(tally.ambiguous)
    found = {str(r[0]) for r in conn.execute(ORDERS_SQL, [ids]).fetchall()} if ids else set()
    with tally.lock:
        for task_id, at in tally.ambiguous.items():
            if task_id in found:
                tally.committed[task_id] = at
            else:
                tally.aborted.add(task_id)
    return len(found), len(ids) - len(found)


def outbox_leftover(conn: psycopg.Connection[Any], kept: list[str]) -> int:
    """Rows in the outbox other than those a newer relay is meant to take."""
    row = conn.execute(OUTBOX_LEFT_SQL, [kept]).fetchone()
    return int(row[0]) if row else 0


@dataclasses.dataclass
class Drain:
    """How the wait for a quiet system ended."""

    drained: bool
    seconds: float
    missing: int
    leftover: int
    broker_pending: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrainCheck:
    """What a scenario waits for before counting: everything executed, nothing pending."""

    conn_factory: Any
    broker: Any  # chaos.sites.Site
    queues: list[str]
    tally: Tally
    scenario: str
    rows: list[poison.Poison]
    reached_broker: Callable[[], Counter[str]]

    def wait(self, timeout: float) -> Drain:
        """Poll until all committed ran, the outbox holds only kept rows and the broker is empty.

        Messages the broker stored that no worker ever ran (lost between broker and worker)
        are not waited for past SETTLE seconds of an otherwise quiet system. The broker's
        cheap emptiness check (pending) is confirmed by its authoritative one (settled).
        """
        began = time.monotonic()
        state = Drain(drained=False, seconds=0.0, missing=-1, leftover=-1, broker_pending=-1)
        quiet_since: float | None = None
        while time.monotonic() - began < timeout:
            missing = self.poll(state)
            if missing is None or state.leftover or state.broker_pending:
                quiet_since = None
            elif not missing:
                if self._settled(state):
                    state.drained = True
                    break
            elif all(self.reached_broker()[tid] for tid in missing):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > SETTLE:
                    state.drained = True
                    break
            time.sleep(POLL)
        state.seconds = time.monotonic() - began
        return state

    def _settled(self, state: Drain) -> bool:
        try:
            return bool(self.broker.settled(self.queues))
        except Exception:  # the broker still coming back: not settled yet
            state.broker_pending = -1
            return False

    def poll(self, state: Drain) -> set[str] | None:
        """Refresh `state`; return the committed ids not executed yet (None: not quiet)."""
        kept = [row.task_id for row in self.rows if row.expect == "kept"]
        committed = set(self.tally.committed)
        try:
            with self.conn_factory() as conn:
                executed = committed & set(executions(conn, self.scenario))
                unapplied = executed - set(effects(conn, self.scenario))
                missing = committed - executed
                missing -= dead_lettered(conn, missing)  # given up on: nothing to wait for
                state.leftover = outbox_leftover(conn, kept)
                settled = poison.settled(conn, self.rows)
            state.broker_pending = int(self.broker.pending(self.queues))
        except Exception:  # a server still coming back is polled again
            return None
        state.missing = len(missing | unapplied)
        # Executed but without its effect yet: its transaction is still on its way (a
        # delivery waiting out a database restart), so the system is not quiet.
        return missing if settled and not unapplied else None


def latency_figures(
    tally: Tally, done: dict[str, Execution], window: tuple[float, float]
) -> dict[str, float | None]:
    """Commit -> first execution: p50/p99 overall, max during the fault, recovery after it."""
    start, end = window
    latencies: list[float] = []
    during: list[float] = []
    backlog_cleared = end
    for task_id, committed_at in tally.committed.items():
        execution = done.get(task_id)
        if execution is None:
            continue
        latency = max(0.0, execution.first_at - committed_at)
        latencies.append(latency)
        if start <= committed_at <= end:
            during.append(latency)
        if committed_at <= end:
            backlog_cleared = max(backlog_cleared, execution.first_at)
    latencies.sort()
    return {
        "latency_p50_s": _round(statistics.median(latencies)) if latencies else None,
        "latency_p99_s": _round(latencies[int(len(latencies) * 0.99)]) if latencies else None,
        "max_latency_during_fault_s": _round(max(during)) if during else None,
        "recovery_s": _round(backlog_cleared - end),
    }


def _round(value: float) -> float:
    return round(value, 3)


def commit_rates(
    tally: Tally, load_window: tuple[float, float], window: tuple[float, float]
) -> dict[str, float]:
    """Commits per second before the fault and during it (writes must keep committing)."""
    times = tally.commit_times()
    before = [t for t in times if load_window[0] <= t < window[0]]
    during = [t for t in times if window[0] <= t <= window[1]]
    return {
        "commits_per_s_before": round(len(before) / max(window[0] - load_window[0], 1e-9), 1),
        "commits_per_s_during": round(len(during) / max(window[1] - window[0], 1e-9), 1),
    }


def count(
    tally: Tally,
    done: dict[str, Execution],
    *,
    journal: set[str],
    published: Counter[str],
    taken: set[str],
    dead: set[str],
    redelivered: set[str],
    applied: Counter[str],
    unacked: set[str],
) -> dict[str, Any]:
    """Committed, executed, effects applied, lost (and where), duplicates (and why), rolled
    back but run.

    `journal`: ids the relays reported published; `published`: copies the broker stored per
    id (Redis: distinct delivery tags, from what MONITOR saw pushed or taken and from the
    lists and unacknowledged set at a restart; RabbitMQ: first deliveries per its firehose);
    `taken`: ids
    a worker took (Redis: into its unacknowledged set; RabbitMQ: delivered); `dead`: ids in
    the dead-letter table; `redelivered`: ids the broker handed out again (Redis: kombu put
    them back after the visibility timeout; RabbitMQ: delivered with a redelivered count);
    `unacked`: ids still in Redis's unacknowledged set when the drain ended (a worker took
    them and nothing has put them back yet: held back, not lost).

    A duplicate (a task id executed more than once) is traced to its source: published twice
    (the relays sent it twice: a crash, a claim session lost, or a publish whose reply was
    lost; docs/reliability.md sources 1-3), or redelivered (sent once, delivered again by the
    broker after a worker lost its connection: source 4). One that is neither is untraced.

    `applied`: effect rows per task id (the OnceTask body's row). Effects applied counts the
    rows of committed ids, so a duplicate effect shows as applied > committed.
    """
    committed = set(tally.committed)
    never = tally.rolled_back | tally.aborted
    executed = committed & set(done)
    missing = committed - executed
    reached_broker = {tid for tid in missing if published[tid]}
    dead_committed = missing & dead
    lost = sorted(missing - reached_broker - dead_committed)
    dup_ids = [tid for tid in executed if done[tid].deliveries > 1]
    republished = {tid for tid in dup_ids if published[tid] > 1}
    again = {tid for tid in dup_ids if done[tid].redeliveries > 0 or tid in redelivered}
    return {
        "committed": len(committed),
        "executed": len(executed),
        "executions": sum(done[tid].deliveries for tid in executed),
        **_effects(committed, applied, reached_broker),
        "lost": len(lost),
        "lost_sample": lost[:10],
        "lost_reported_published": len(set(lost) & journal),
        "dead_lettered": len(dead_committed),
        "dead_lettered_sample": sorted(dead_committed)[:10],
        "lost_after_broker": len(reached_broker),
        "lost_after_broker_sample": sorted(reached_broker)[:10],
        "lost_after_broker_taken_by_worker": len(reached_broker & taken),
        "lost_after_broker_still_unacked": len(reached_broker & unacked),
        "committed_seen_by_broker": sum(1 for tid in committed if published[tid]),
        "duplicates": len(dup_ids),
        "duplicates_sample": [
            _duplicate(tid, done[tid], published) for tid in sorted(dup_ids)[:10]
        ],
        "extra_executions": sum(done[tid].deliveries - 1 for tid in executed),
        "duplicate_rate": round(len(dup_ids) / len(committed), 5) if committed else 0.0,
        "duplicates_republished": sum(1 for tid in committed if published[tid] > 1),
        "duplicates_redelivered": len(again - republished),
        "duplicates_untraced": len(set(dup_ids) - republished - again),
        "duplicates_untraced_sample": [
            {**_duplicate(tid, done[tid], published), "in_journal": tid in journal}
            for tid in sorted(set(dup_ids) - republished - again)[:10]
        ],
        "rolled_back": len(tally.rolled_back),
        "aborted_by_errors": len(tally.aborted),
        "rolled_back_executed": len(never & set(done)),
        "rolled_back_published": sum(1 for tid in never if published[tid]),
        "unknown_executed": len(set(done) - committed - never),
    }


def _effects(committed: set[str], applied: Counter[str], excused: set[str]) -> dict[str, Any]:
    """Effects applied (rows of committed ids), and what is wrong with them if anything.

    A committed id without its effect is missing unless it is `excused`: lost after the
    broker had it (no worker ever ran it), a loss the broker's transport reports in its own
    column and no inbox can undo.
    """
    missing = sorted(tid for tid in committed if not applied[tid] and tid not in excused)
    twice = sorted(tid for tid in committed if applied[tid] > 1)
    return {
        "effects_applied": sum(applied[tid] for tid in committed),
        "effects_missing": len(missing),
        "effects_missing_sample": missing[:10],
        "effects_twice": len(twice),
        "effects_twice_sample": twice[:10],
        "effects_unexpected": sum(n for tid, n in applied.items() if tid not in committed),
    }


def _duplicate(task_id: str, execution: Execution, published: Counter[str]) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "executions": execution.deliveries,
        "redelivered": execution.redeliveries,
        "stored_copies": published[task_id],  # Redis: delivery tags; RabbitMQ: first deliveries
    }


def timeline(
    tally: Tally, done: dict[str, Execution], origin: float, bucket: float = 1.0
) -> list[tuple[float, int, float]]:
    """Per `bucket` seconds of commit time: (start, commits, max commit -> execution)."""
    buckets: dict[int, list[float]] = {}
    for task_id, committed_at in tally.committed.items():
        execution = done.get(task_id)
        latency = max(0.0, execution.first_at - committed_at) if execution else float("inf")
        buckets.setdefault(int((committed_at - origin) // bucket), []).append(latency)
    return [
        (round(index * bucket, 1), len(values), _round(max(values)))
        for index, values in sorted(buckets.items())
    ]


def not_stored(tally: Tally, received: Counter[str], stored: Counter[str]) -> int:
    """Publishes of committed messages the broker received but did not store: refused (a
    RabbitMQ queue at its length limit nacks them) or cut off (the node stopped before
    storing); 0 on Redis, where received and stored are the same count."""
    return sum(max(0, received[tid] - stored[tid]) for tid in tally.committed)


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours structlog's console renderer may add
FAILED_EVENT = re.compile(r"outbox\.publish_failed\b.*?\btask_id=['\"]?([^\s'\"]+)")


def retries_spent(logs: Iterable[str], committed: set[str]) -> set[str]:
    """Committed task ids for which a relay logged outbox.publish_failed (a retry spent).

    The writers' task never fails to publish on its own, so each one is a broker fault the
    relay blamed on a message: the contract says an outage spends no retries.
    """
    found: set[str] = set()
    for text in logs:
        found.update(FAILED_EVENT.findall(ANSI.sub("", text)))
    return found & committed
