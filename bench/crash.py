"""Crash recovery: SIGKILL one of two relays in the middle of a backlog.

Both relays start on an empty table in their own databases (the crash slot, so a long wait
can overlap other scenarios without touching their tables); the backlog is committed; once
a twentieth of it is gone both relays are frozen with SIGSTOP, the rows held at that instant are
read, the victim gets SIGKILL and the survivor SIGCONT. The figure is the time from the kill
until every one of those rows is published (a relay deletes a row only after the broker has
it), capped. The rest of the backlog is drained first, so the wait overlaps nothing heavy.

Rows held: ours are the rows locked by an open claim (found by trying to lock every row with
SKIP LOCKED while the relays are frozen); the peer's are the rows marked in flight
(updated_at set, no retry_after), which is how it claims. Both relays' rows are counted: the
survivor's are published within its batch, so the wait is the victim's.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from bench import db
from bench.procs import BenchError, Proc, socket_ports, wait_until
from bench.services import connect
from bench.sides import Side, Slot, World, crash_slot

# Rows committed before the kill. Ours drains an order of magnitude faster, so it needs more
# rows for the kill to land mid-backlog; the figure (kill -> held rows published) does not
# depend on the backlog's size. RabbitMQ takes fewer: publishing with confirms is slower
# there, and the wait for the rest of the backlog would dominate the run.
BACKLOG = {"ours": 20_000, "peer": 5_000}
QUICK_BACKLOG = {"ours": 10_000, "peer": 2_000}
BACKLOG_RABBITMQ = {"ours": 10_000, "peer": 5_000}
QUICK_BACKLOG_RABBITMQ = {"ours": 5_000, "peer": 2_000}
CAP = 330.0  # seconds; the peer's stale timeout is 300 s
QUICK_CAP = 20.0
KILL_AT = 0.05  # share of the backlog drained before the first try to kill
FREEZE_TRIES = 200
FREEZE_PAUSE = 0.005  # seconds the relays run between two tries
BATCH_SIZE = 100  # both relays' default --batch-size
POLL = 0.1  # seconds between checks of the held rows
REST_TIMEOUT = 180.0  # seconds for the survivor to drain everything else

IN_FLIGHT = {
    "ours": "WITH free AS (SELECT id FROM outbox_notify_message_v1 FOR UPDATE SKIP LOCKED)"
    " SELECT id FROM outbox_notify_message_v1 EXCEPT SELECT id FROM free",
    "peer": "SELECT id FROM celery_outbox WHERE updated_at IS NOT NULL AND retry_after IS NULL",
}
VICTIM_IN_CLAIM = (
    "SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY(%s) AND xact_start IS NOT NULL"
)


@dataclass
class Pending:
    """A kill that happened; the wait for its rows may still be going on in a thread."""

    side: str
    held: list[int]
    killed_at: float
    cap: float
    backlog: int
    result: dict[str, Any] = field(default_factory=dict)
    error: list[BaseException] = field(default_factory=list)
    thread: threading.Thread | None = None
    survivor: Proc | None = None

    def join(self, world: World) -> dict[str, Any]:
        """Wait for the watch to end, then stop the surviving relay."""
        if self.thread is not None:
            self.thread.join()
        if self.survivor is not None:
            world.procs.stop(self.survivor)
        if self.error:
            raise self.error[0]
        # Counted once the survivor is gone: a message published twice shows as one extra.
        side = _side(world, self.side)
        published = world.broker.depth(world.queue(side, _slot(world)))
        delivered = self.backlog - self.result["unpublished_at_cap"]
        return {**self.result, "duplicates": published - delivered}


def _side(world: World, key: str) -> Side:
    return next(s for s in world.sides if s.key == key)


def _slot(world: World) -> Slot:
    return crash_slot(world.broker.key)


def start(world: World, side: Side) -> Pending:
    """Kill one relay mid-backlog; return once only the held rows may remain."""
    backlog = _backlog(world)[side.key]
    cap = QUICK_CAP if world.quick else CAP
    db.reset(world, side, _slot(world))
    relays = world.start_relays(side, 2, _slot(world))
    survivor = relays[1]
    try:
        time.sleep(1.0)
        db.fill(world, side, backlog, _slot(world))
        wait_until(
            lambda: db.count(world, side, _slot(world)) <= backlog * (1 - KILL_AT),
            120.0,
            f"{side.label} to start draining",
            0.005,
        )
        held, killed_at = kill_one(world, side, relays)
    except BaseException:
        for relay in relays:
            world.procs.stop(relay)
        raise
    pending = Pending(
        side=side.key, held=held, killed_at=killed_at, cap=cap, backlog=backlog, survivor=survivor
    )
    pending.thread = threading.Thread(
        target=_watch, args=(world, side, pending, survivor), daemon=True
    )
    pending.thread.start()
    _drain_rest(world, side, held)
    return pending


def _backlog(world: World) -> dict[str, int]:
    if world.broker.key == "rabbitmq":
        return QUICK_BACKLOG_RABBITMQ if world.quick else BACKLOG_RABBITMQ
    return QUICK_BACKLOG if world.quick else BACKLOG


def kill_one(world: World, side: Side, relays: list[Proc]) -> tuple[list[int], float]:
    """Freeze both relays at an instant the victim holds rows; kill it; resume the other."""
    victim, survivor = relays
    for _ in range(FREEZE_TRIES):
        for relay in relays:
            relay.send(signal.SIGSTOP)
        held = _held(world, side)
        # More than one batch held means both relays hold rows, the victim included.
        if len(held) > BATCH_SIZE and _victim_holds(world, side, victim):
            victim.send(signal.SIGKILL)
            killed_at = time.monotonic()
            survivor.send(signal.SIGCONT)
            world.procs.stop(victim)
            return held, killed_at
        for relay in relays:
            relay.send(signal.SIGCONT)
        time.sleep(FREEZE_PAUSE)
    raise BenchError(f"never caught a {side.label} relay holding rows")


def _held(world: World, side: Side) -> list[int]:
    with connect(world.dsn(side, _slot(world))) as conn, conn.transaction():
        rows = conn.execute(IN_FLIGHT[side.key]).fetchall()
    return [int(r[0]) for r in rows]


def _victim_holds(world: World, side: Side, victim: Proc) -> bool:
    if side.key != "ours":
        return True  # the peer marks rows in flight and drops its connection: no backend to ask
    ports = socket_ports(victim.pid)
    with connect(world.pg.admin_dsn) as conn:
        row = conn.execute(VICTIM_IN_CLAIM, (ports,)).fetchone()
    return bool(row and row[0])


def _remaining(world: World, side: Side, held: list[int]) -> tuple[int, int]:
    """(held rows still in the table, other rows still in the table)."""
    query = sql.SQL(
        "SELECT count(*) FILTER (WHERE id = ANY(%s)), count(*) FILTER (WHERE NOT id = ANY(%s)) FROM {}"
    ).format(sql.Identifier(side.table))
    with connect(world.dsn(side, _slot(world))) as conn:
        row = conn.execute(query, (held, held)).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def _drain_rest(world: World, side: Side, held: list[int]) -> None:
    wait_until(
        lambda: _remaining(world, side, held)[1] == 0,
        REST_TIMEOUT,
        f"the surviving {side.label} relay to drain the rest",
    )


def _watch(world: World, side: Side, pending: Pending, survivor: Proc) -> None:
    try:
        deadline = pending.killed_at + pending.cap
        left = len(pending.held)
        while time.monotonic() < deadline:
            left = _remaining(world, side, pending.held)[0]
            if left == 0:
                break
            time.sleep(POLL)
        seconds = time.monotonic() - pending.killed_at
        pending.result = {
            "side": side.key,
            "broker": world.broker.key,
            "held_at_kill": len(pending.held),
            "recovered": left == 0,
            "seconds": seconds if left == 0 else None,
            "cap_s": pending.cap,
            "unpublished_at_cap": left,
            "survivor_alive": survivor.alive(),
            "backlog": pending.backlog,
        }
    except BaseException as exc:  # handed to the main thread by join()
        pending.error.append(exc)
