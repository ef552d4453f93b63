"""What a claim costs with dead rows in the table, for four ways of claiming (docs/concepts.md).

    python -m bench.claim_designs [--dead 0,100000,1000000] [--batch 100] [--quick] [--json PATH]

An old snapshot (a REPEATABLE READ transaction left open on another connection) keeps every
row deleted after it in the table and in its indexes. Four designs claim 100 fresh rows
(--batch) with N such dead rows in the table; each claim is timed (median of several, each
letting its rows go untouched). `--batch 1` times what a claim costs whatever it finds: at
one row per claim, the rate at which a relay woken per commit works, that sets the commit ->
broker latency.

- scan: the released claim, the "ready now" index read from its start in id order;
- lookback: a keyset on id from the relay's last claimed id minus a fixed look-back window;
- rotation: two partitions written in turn, the drained one truncated (TRUNCATE needs an
  ACCESS EXCLUSIVE lock: a snapshot that has read the table, as pg_dump's has, blocks it);
- frontier: this release's claim (sql/queries.sql claim_batch, outbox_notify/relay/frontier.py).

Each runs twice: beside a snapshot that never read the outbox, and beside one that did (it
holds an ACCESS SHARE lock on it, like pg_dump). A last column says whether a row whose
transaction was open the whole time (ids older than everything else) is claimed once it
commits. PostgreSQL is OUTBOX_TEST_DATABASE_URL, else a private throwaway server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg import sql as pgsql

from devtools import pgserver
from outbox_notify import sql as queries_sql
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.store import claim_text, claimed_rows, stable_int_types
from outbox_notify.serialization import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
BATCH = 100  # rows a timed claim takes (--batch)
REPEATS = 7  # timed claims per design and size (the median is reported)
LOOKBACK = 10_000  # ids the lookback design reads behind its last claimed id
FULL_SIZES = (0, 100_000, 1_000_000)
QUICK_SIZES = (0, 50_000)
DESIGNS = ("scan", "lookback", "rotation", "frontier")

# The relay's planner settings for a claim (sql/queries.sql set_claim_timeout): its prepared
# claim keeps one generic plan.
PLAN = (
    "SELECT set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true),"
    " set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true),"
    " set_config('plan_cache_mode', 'force_generic_plan', true)"
)
FILL = pgsql.SQL(
    "INSERT INTO {table} (task_id, task_name, args, kwargs, options, schema_version, part)"
    " SELECT md5(n::text), 'bench.add', '[1, 2]', '{{}}', '{{}}', %(version)s, %(part)s"
    " FROM generate_series(1, %(rows)s) AS n"
)
FILL_OUTBOX = (
    "INSERT INTO outbox_notify_message_v1"
    " (task_id, task_name, args, kwargs, options, schema_version)"
    " SELECT md5(n::text), 'bench.add', '[1, 2]', '{}', '{}', %(version)s"
    " FROM generate_series(1, %(rows)s) AS n"
)
# Every design fetches what a relay needs to publish a row, as the frontier's claim does
# (ids alone made the other designs' claims of 100 rows look cheaper than they are).
ROW = (
    "SELECT id, task_id, task_name, args::text, kwargs::text, options::text, context::text,"
    " retries, schema_version, created_at FROM {table}"
)
SCAN = pgsql.SQL(
    ROW + " WHERE retry_after IS NULL AND schema_version <= %(version)s"
    " ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
)
LOOKBACK_CLAIM = pgsql.SQL(
    ROW + " WHERE retry_after IS NULL AND id > %(after)s"
    " AND schema_version <= %(version)s ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
)
DELETE_IDS = pgsql.SQL("DELETE FROM {table} WHERE id = ANY(%s)")
DELETE_ALL = pgsql.SQL("DELETE FROM {table}")
MAX_ID = pgsql.SQL("SELECT max(id) FROM {table}")
TRUNCATE = pgsql.SQL("TRUNCATE {table}")


@contextlib.contextmanager
def server_url() -> Iterator[str]:
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    with pgserver.running() as server:
        yield server.url()


@contextlib.contextmanager
def scratch_database(url: str, *, scan_index: bool) -> Iterator[str]:
    """A database of its own with this checkout's schema; dropped afterwards.

    `scan_index`: add the index the released claim read (the scan and lookback designs').
    Only for them: a claim planned once for any parameters (the relay's generic plan) may
    pick it for a part it fits badly, and read every dead row the other designs avoid.
    """
    name = f"claim_designs_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    dsn = psycopg.conninfo.make_conninfo(url, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(queries_sql.read("install.sql"))
            conn.execute(ROTATION_DDL)
            if scan_index:
                # What the released claim read; this release has no such index.
                conn.execute(
                    "CREATE INDEX scan_ready_idx ON outbox_notify_message_v1 (id)"
                    " WHERE retry_after IS NULL"
                )
        yield dsn
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


# Two partitions written in turn; `part` says which. The ready index of each partition is
# read from its start, like the released claim.
ROTATION_DDL = """
CREATE TABLE rotating (LIKE outbox_notify_message_v1 INCLUDING DEFAULTS INCLUDING IDENTITY,
                       part smallint NOT NULL)
    PARTITION BY LIST (part);
CREATE TABLE rotating_0 PARTITION OF rotating FOR VALUES IN (0);
CREATE TABLE rotating_1 PARTITION OF rotating FOR VALUES IN (1);
CREATE INDEX ON rotating (id) WHERE retry_after IS NULL;
"""


class Design:
    """One way of claiming, with the state a relay of that design would keep."""

    table = pgsql.Identifier("outbox_notify_message_v1")

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn)
        # Prepared at once, as a relay's claim is after its first few: no planning timed.
        self.conn.prepare_threshold = 0

    def close(self) -> None:
        self.conn.close()

    def fill(self, rows: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self.write(conn, rows)

    def write(self, conn: psycopg.Connection[Any], rows: int) -> None:
        """Insert `rows` rows on `conn`, in its transaction."""
        conn.execute(FILL_OUTBOX, {"rows": rows, "version": SCHEMA_VERSION})

    def claim(self, limit: int) -> list[int]:
        """Claim up to `limit` rows in the open transaction; their ids."""
        raise NotImplementedError

    def publish_all(self) -> None:
        """Claim and delete everything claimable, as the relay of this design would."""
        while True:
            with self.conn.transaction():
                self.conn.execute(PLAN)
                ids = self.claim(500)
                self.conn.execute(DELETE_IDS.format(table=self.table), [ids])
            if not ids:
                return

    def delete_all(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(DELETE_ALL.format(table=self.table))

    def after_publish(self, blocked: bool) -> None:
        """Maintenance between batches (rotation's truncate)."""

    def timed_claim(self, batch: int) -> float:
        """Seconds one claim of `batch` rows takes; its rows are let go untouched.

        Committed, not rolled back: the claim changed nothing, and psycopg forgets the
        statements it prepared on a connection that rolls back, so every claim was planned
        again and timed with its planning, which a relay (ClaimStore.release) does not pay.
        """
        self.conn.execute(PLAN)
        started = time.perf_counter()
        ids = self.claim(batch)
        elapsed = time.perf_counter() - started
        self.conn.commit()
        if len(ids) != batch:
            raise RuntimeError(f"{type(self).__name__} claimed {len(ids)} rows, not {batch}")
        return elapsed


class Scan(Design):
    def claim(self, limit: int) -> list[int]:
        q = SCAN.format(table=self.table)
        return [r[0] for r in self.conn.execute(q, {"limit": limit, "version": SCHEMA_VERSION})]


class Lookback(Design):
    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.last = 0

    def claim(self, limit: int) -> list[int]:
        params = {"after": self.last - LOOKBACK, "limit": limit, "version": SCHEMA_VERSION}
        ids = [r[0] for r in self.conn.execute(LOOKBACK_CLAIM.format(table=self.table), params)]
        if ids:
            self.last = max(self.last, *ids)
        return ids

    def delete_all(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(MAX_ID.format(table=self.table)).fetchone()
        self.last = max(self.last, int(row[0] or 0) if row else 0)  # as if it had claimed them
        super().delete_all()


class Rotation(Design):
    table = pgsql.Identifier("rotating")

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.current = 0

    def write(self, conn: psycopg.Connection[Any], rows: int) -> None:
        params = {"rows": rows, "version": SCHEMA_VERSION, "part": self.current}
        conn.execute(FILL.format(table=self.table), params)

    def claim(self, limit: int) -> list[int]:
        q = SCAN.format(table=self.table)
        return [r[0] for r in self.conn.execute(q, {"limit": limit, "version": SCHEMA_VERSION})]

    def after_publish(self, blocked: bool) -> None:
        """Write the other partition from now on; truncate this one if nothing holds it."""
        drained, self.current = self.current, 1 - self.current
        with psycopg.connect(self.dsn, autocommit=False) as conn:
            conn.execute("SET lock_timeout = '100ms'")
            with contextlib.suppress(psycopg.errors.LockNotAvailable):
                conn.execute(TRUNCATE.format(table=pgsql.Identifier(f"rotating_{drained}")))
                conn.commit()


class FrontierDesign(Design):
    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        # As the relay's claim connection: every int a bigint, so that a position crossing
        # 32,767 (or LAST_ID) does not prepare and plan the claim again, inside a timed claim.
        stable_int_types(self.conn)
        self.frontier = Frontier()
        self.query = queries_sql.queries()["claim_batch"]
        self.shapes: dict[tuple[bool, bool], tuple[LiteralString, tuple[str, ...]]] = {}
        self.cursor = psycopg.RawCursor(self.conn)

    def claim(self, limit: int) -> list[int]:
        asked = self.frontier.params()
        # What the relay runs (ClaimStore.claim): the shape without the parts that have
        # nothing to read this time, in `$1` parameters converted once. Named parameters
        # cost psycopg a conversion of the whole statement at every call (it caches only
        # short ones), which the relay does not pay.
        key = (bool(asked["recheck"]), bool(asked["late"]))
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = queries_sql.positional(claim_text(self.query, *key))
        text, names = shape
        values = {**asked, "limit": limit, "max_version": SCHEMA_VERSION}
        self.cursor.execute(text, [values[name] for name in names])
        records = self.cursor.fetchall()
        rows, taken, seen = claimed_rows(records, limit)
        self.frontier.absorb(asked, taken, seen)
        return [r.id for r in rows]

    def timed_claim(self, batch: int) -> float:
        # The state a claim leaves is what the next claim starts from; a timed claim is
        # let go untouched, so it must not move the frontier past the rows it gave back.
        saved = (self.frontier.ready, self.frontier.due, self.frontier.scheduled)
        late, recheck = set(self.frontier.late), set(self.frontier.recheck)
        try:
            return super().timed_claim(batch)
        finally:
            self.frontier.ready, self.frontier.due, self.frontier.scheduled = saved
            self.frontier.late, self.frontier.recheck = late, recheck


MAKERS: dict[str, Callable[[str], Design]] = {
    "scan": Scan,
    "lookback": Lookback,
    "rotation": Rotation,
    "frontier": FrontierDesign,
}


@contextlib.contextmanager
def old_snapshot(dsn: str, *, read_outbox: bool) -> Iterator[None]:
    """A REPEATABLE READ transaction left open; it reads the outbox tables when asked."""
    with psycopg.connect(dsn, autocommit=False) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")
        if read_outbox:
            conn.execute("SELECT count(*) FROM outbox_notify_message_v1")
            conn.execute("SELECT count(*) FROM rotating")
        yield
        conn.rollback()


def measure(
    dsn: str, design: str, sizes: Sequence[int], read_outbox: bool, batch: int = BATCH
) -> dict[str, Any]:
    """Claim cost per dead-row count for one design beside one kind of old snapshot."""
    relay = MAKERS[design](dsn)
    results: dict[str, Any] = {"claim_ms": {}, "late_found": None}
    try:
        with old_snapshot(dsn, read_outbox=read_outbox):
            dead = 0
            for size in sizes:
                if size > dead:
                    # Published in bulk (a DELETE) rather than claim by claim, so the slow
                    # designs do not take hours to get there; then one claim, which moves a
                    # keyset design past them as its relay would have.
                    relay.fill(size - dead)
                    relay.delete_all()
                    relay.publish_all()
                    relay.after_publish(blocked=read_outbox)
                    dead = size
                relay.fill(batch)
                times = [relay.timed_claim(batch) for _ in range(REPEATS)]
                results["claim_ms"][str(size)] = round(statistics.median(times) * 1000, 3)
                relay.publish_all()
                dead += batch
            results["late_found"] = late_commit_found(dsn, relay, batch)
    finally:
        relay.close()
    return results


def late_commit_found(dsn: str, relay: Design, batch: int = BATCH) -> bool:
    """Is a row written early and committed late (after many later rows) claimed at commit?"""
    with psycopg.connect(dsn, autocommit=False) as late_writer:
        relay.write(late_writer, 1)
        # Enough rows after it for a look-back window to have passed it.
        relay.fill(LOOKBACK + 2 * batch)
        relay.publish_all()
        late_writer.commit()
    with relay.conn.transaction():
        relay.conn.execute(PLAN)
        return bool(relay.claim(batch))


def run(
    sizes: Sequence[int], designs: Sequence[str] = DESIGNS, batch: int = BATCH
) -> dict[str, Any]:
    figures: dict[str, Any] = {"sizes": list(sizes), "batch": batch, "designs": {}}
    with server_url() as url:
        for design in designs:
            figures["designs"][design] = {}
            for read_outbox in (False, True):
                with scratch_database(url, scan_index=design in ("scan", "lookback")) as dsn:
                    key = "snapshot_read_outbox" if read_outbox else "snapshot_elsewhere"
                    result = measure(dsn, design, sizes, read_outbox, batch)
                    figures["designs"][design][key] = result
                    print(design, key, json.dumps(result), flush=True)
    return figures


def markdown(figures: dict[str, Any]) -> str:
    """The report's section: claim time per design, dead rows, snapshot kind."""
    sizes = figures["sizes"]
    head = " | ".join(f"{int(n):,} dead" for n in sizes)
    batch = figures["batch"]
    rows = "1 fresh row" if batch == 1 else f"{batch} fresh rows"
    lines = [
        f"Median time of one claim of {rows}, with this many dead rows "
        "in the table behind an old snapshot (`python -m bench.claim_designs`). Last column: "
        "is a row whose transaction stayed open the whole time claimed once it commits?",
        "",
        f"| design | old snapshot | {head} | late commit claimed |",
        "|---|---|" + "---|" * len(sizes) + "---|",
    ]
    labels = {"snapshot_elsewhere": "never read the outbox", "snapshot_read_outbox": "read it"}
    for design, by_kind in figures["designs"].items():
        for kind, result in by_kind.items():
            cells = " | ".join(f"{result['claim_ms'][str(n)]:.2f} ms" for n in sizes)
            found = "yes" if result["late_found"] else "**no**"
            lines.append(f"| {design} | {labels[kind]} | {cells} | {found} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.claim_designs")
    parser.add_argument("--dead", help="comma-separated dead-row counts")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}")
    parser.add_argument("--designs", help=f"comma-separated, of {', '.join(DESIGNS)}")
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per timed claim")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.dead:
        sizes = tuple(int(n) for n in args.dead.split(","))
    designs = tuple(args.designs.split(",")) if args.designs else DESIGNS
    figures = run(sizes, designs, args.batch)
    print(markdown(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
