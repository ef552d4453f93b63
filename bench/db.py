"""Small SQL helpers the scenarios share: empty a table, count it, fill it, read server stats."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg
from psycopg import errors, sql

from bench.procs import BenchError
from bench.services import connect
from bench.sides import MAIN, Side, Slot, World, fill_sql

DROP_OUR_TRIGGER = "DROP TRIGGER outbox_notify_wake_v1 ON outbox_notify_message_v1"
OUR_TRIGGER_DEF = (
    "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'outbox_notify_wake_v1'"
)


def reset(world: World, side: Side, slot: Slot = MAIN) -> None:
    """Empty the side's outbox and dead-letter tables and its queue on the broker; checkpoint."""
    tables = [
        side.table,
        "outbox_notify_dead_letter_v1" if side.key == "ours" else "celery_outbox_dead_letter",
    ]
    with connect(world.dsn(side, slot)) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(map(sql.Identifier, tables))))
        # Every full-mode run starts right after a checkpoint, so none gets one in its middle
        # by chance (quick mode saves the time: its figures are indicative only).
        if not world.quick:
            with contextlib.suppress(errors.InsufficientPrivilege):
                conn.execute("CHECKPOINT")
    world.broker.purge(world.queue(side, slot))


def count(world: World, side: Side, slot: Slot = MAIN) -> int:
    with connect(world.dsn(side, slot)) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(side.table))
        ).fetchone()
    return int(row[0]) if row else 0


def fill(world: World, side: Side, rows: int, slot: Slot = MAIN) -> None:
    """Commit `rows` copies of the side's template row in one transaction."""
    with connect(world.dsn(side, slot)) as conn:
        conn.execute(fill_sql(side, rows))


class PendingFill:
    """A backlog inserted but not yet committed, so the commit instant can be chosen."""

    def __init__(self, world: World, side: Side, rows: int, slot: Slot = MAIN) -> None:
        self.conn = psycopg.connect(world.dsn(side, slot), autocommit=False)
        self.conn.execute(fill_sql(side, rows))

    def commit(self) -> float:
        """Commit; the monotonic time the commit returned."""
        self.conn.commit()
        committed = time.monotonic()
        self.conn.close()
        return committed

    def close(self) -> None:
        self.conn.close()


def our_trigger(world: World) -> str:
    """The CREATE TRIGGER statement migrate installed on our table."""
    with connect(world.dsn(_ours(world))) as conn:
        row = conn.execute(OUR_TRIGGER_DEF).fetchone()
    if row is None:
        raise BenchError("the outbox_notify_wake_v1 trigger is missing after migrate")
    return str(row[0])


def _ours(world: World) -> Side:
    return next(s for s in world.sides if s.key == "ours")


@contextlib.contextmanager
def without_our_trigger(world: World) -> Any:
    """Our table without its trigger for the block; the trigger is put back in any case."""
    definition = our_trigger(world)
    with connect(world.dsn(_ours(world))) as conn:
        conn.execute(DROP_OUR_TRIGGER)
        try:
            yield
        finally:
            conn.execute(definition)


def database_stats(world: World, dbname: str, statements: bool) -> dict[str, float | None]:
    """Cumulative counters of one database: statements run, sessions opened, transactions."""
    with connect(world.pg.admin_dsn) as conn:
        row = conn.execute(
            "SELECT sessions, xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (dbname,),
        ).fetchone()
        calls = None
        if statements:
            found = conn.execute(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)",
                (dbname,),
            ).fetchone()
            calls = float(found[0]) if found else None
    sessions, transactions = row if row else (None, None)
    return {"statements": calls, "sessions": _float(sessions), "transactions": _float(transactions)}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def notify_calls(world: World, dbname: str) -> float:
    """pg_notify() calls run in one database so far (the trigger's, seen with track=all)."""
    with connect(world.pg.admin_dsn) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query ILIKE '%%pg_notify%%'"
            " AND dbid = (SELECT oid FROM pg_database WHERE datname = %s)",
            (dbname,),
        ).fetchone()
    return float(row[0]) if row else 0.0


def statement_calls(world: World, dbname: str) -> dict[str, float]:
    """Calls so far of each normalised statement run in one database (pg_stat_statements)."""
    with connect(world.pg.admin_dsn) as conn:
        rows = conn.execute(
            "SELECT query, sum(calls) FROM pg_stat_statements"
            " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) GROUP BY query",
            (dbname,),
        ).fetchall()
    return {_one_line(str(q)): float(n) for q, n in rows}


def _one_line(query: str) -> str:
    """The statement without its -- comments, on one line."""
    lines = (line.split("--", 1)[0] for line in query.splitlines())
    return " ".join(" ".join(lines).split())
