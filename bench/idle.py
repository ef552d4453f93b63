"""Idle cost: what a relay with nothing to do costs the database and the machine.

One relay per library, both at once (each on its own database, so the counters separate),
on empty tables. Over the window: statements run in its database (pg_stat_statements),
sessions opened (pg_stat_database.sessions: each is a new connection, a fork on the server),
transactions, and the relay's own CPU time from /proc.
"""

from __future__ import annotations

import time
from typing import Any

from bench import db
from bench.procs import Proc
from bench.services import stat_statements_ready
from bench.sides import MAIN, World

WINDOW = 60.0  # seconds
QUICK_WINDOW = 15.0
WARMUP = 5.0  # seconds after start-up before counting
QUICK_WARMUP = 2.0
# PostgreSQL 15 flushes an idle backend's counters to pg_stat_database after about 10 s.
STATS_FLUSH = 1.0  # seconds
TOP_STATEMENTS = 8


def run(world: World) -> dict[str, Any]:
    window = QUICK_WINDOW if world.quick else WINDOW
    statements = stat_statements_ready(world.pg)
    for side in world.sides:
        db.reset(world, side)
    with world.procs.started(lambda: _start_all(world)) as relays:
        time.sleep(QUICK_WARMUP if world.quick else WARMUP)
        before = _snapshot(world, relays, statements)
        time.sleep(window)
        after = _snapshot(world, relays, statements)
    rows = [_row(side.key, before[side.key], after[side.key], window) for side in world.sides]
    return {"window_s": window, "pg_stat_statements": statements, "rows": rows}


def _start_all(world: World) -> list[Proc]:
    """One relay per library, started together, each waited for."""
    relays = [world.start_relay(side) for side in world.sides]
    for side, relay in zip(world.sides, relays, strict=True):
        relay.wait_for_output(side.ready_marker)
    return relays


def _snapshot(world: World, relays: list[Any], statements: bool) -> dict[str, dict[str, Any]]:
    time.sleep(STATS_FLUSH)
    snap = {}
    for side, relay in zip(world.sides, relays, strict=True):
        counters = db.database_stats(world, MAIN.database(side), statements)
        calls = db.statement_calls(world, MAIN.database(side)) if statements else {}
        snap[side.key] = {**counters, "calls": calls, "cpu": relay.cpu(), "at": time.monotonic()}
    return snap


def _per_minute(before: float | None, after: float | None, seconds: float) -> float | None:
    if before is None or after is None:
        return None
    return (after - before) / seconds * 60


def _row(side: str, before: dict[str, Any], after: dict[str, Any], window: float) -> dict[str, Any]:
    seconds = after["at"] - before["at"]
    return {
        "side": side,
        "seconds": seconds,
        "statements_per_min": _per_minute(before["statements"], after["statements"], seconds),
        "connections_per_min": _per_minute(before["sessions"], after["sessions"], seconds),
        "transactions_per_min": _per_minute(before["transactions"], after["transactions"], seconds),
        "relay_cpu_s": after["cpu"] - before["cpu"],
        "relay_cpu_s_per_min": (after["cpu"] - before["cpu"]) / seconds * 60,
        "top_statements_per_min": _top(before["calls"], after["calls"], seconds),
    }


def _top(before: dict[str, float], after: dict[str, float], seconds: float) -> list[Any]:
    """The statements run most often in the window, with their rate per minute."""
    delta = {q: n - before.get(q, 0.0) for q, n in after.items()}
    ranked = sorted(((n, q) for q, n in delta.items() if n > 0), reverse=True)[:TOP_STATEMENTS]
    return [{"statement": q[:160], "per_min": n / seconds * 60} for n, q in ranked]
