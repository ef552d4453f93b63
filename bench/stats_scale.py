"""How long `outbox_stats` takes on a big outbox: 1,000,000 rows and 100,000 dead letters.

Run: .venv/bin/python -m bench.stats_scale [--messages N] [--dead-letters N] [--runs N] [--vacuum]

Starts a private PostgreSQL (devtools.pgserver), applies sql/install.sql, bulk-loads rows with
generate_series (1% of them waiting for a retry, spread over 50 task names), runs ANALYZE,
then times outbox_notify.stats.collect() and prints the median wall time of --runs runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg

from devtools import pgserver
from outbox_notify import sql as sql_files
from outbox_notify import stats

LOAD_MESSAGES = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, retry_after,
     last_error, created_at)
SELECT md5(i::text), 'bench.task_' || (i %% 50), '[1, 2]', '{}',
       '{"headers": {}, "relative": {}}', 1,
       CASE WHEN i %% 97 = 0 THEN 1 + i %% 4 ELSE 0 END,
       CASE WHEN i %% 97 = 0 THEN now() + make_interval(secs => i %% 600) END,
       CASE WHEN i %% 97 = 0 THEN 'ConnectionError' END,
       now() - make_interval(secs => (%(count)s - i) / 1000.0)
FROM generate_series(1, %(count)s) AS i
"""
LOAD_DEAD_LETTERS = """
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, schema_version, retries, failure_reason,
     created_at, dead_at)
SELECT md5('dead' || i), 'bench.task_' || (i %% 20), '[1, 2]', '{}',
       '{"headers": {}, "relative": {}}', 1, 5, 'gave up after 5 retries',
       now() - interval '61 days', now() - make_interval(secs => i * 50)
FROM generate_series(1, %(count)s) AS i
"""


def load(conn: psycopg.Connection, messages: int, dead_letters: int, vacuum: bool) -> float:
    """Create the schema and the rows, then ANALYZE (or VACUUM ANALYZE); return the seconds."""
    started = time.perf_counter()
    conn.execute(sql_files.read("install.sql"))
    conn.execute(LOAD_MESSAGES, {"count": messages})
    conn.execute(LOAD_DEAD_LETTERS, {"count": dead_letters})
    if vacuum:  # as autovacuum leaves a settled table: visibility map set, index-only scans
        conn.execute("VACUUM ANALYZE outbox_notify_message_v1, outbox_notify_dead_letter_v1")
    else:
        conn.execute("ANALYZE outbox_notify_message_v1, outbox_notify_dead_letter_v1")
    return time.perf_counter() - started


def time_collect(conn: psycopg.Connection, runs: int, top: int) -> list[float]:
    """Wall time in seconds of each of `runs` stats snapshots (after one warm-up run)."""
    stats.collect(conn, top=top)
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        stats.collect(conn, top=top)
        timings.append(time.perf_counter() - started)
    return timings


def report(label: str, timings: list[float]) -> str:
    """One line: the median, min and max of the timings in milliseconds."""
    return (
        f"{label}: median {statistics.median(timings) * 1000:.1f} ms over {len(timings)} runs "
        f"(min {min(timings) * 1000:.1f} ms, max {max(timings) * 1000:.1f} ms)"
    )


def main() -> None:
    """Parse flags, run the benchmark on a private server, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--dead-letters", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vacuum", action="store_true", help="VACUUM ANALYZE, not just ANALYZE")
    args = parser.parse_args()
    with (
        pgserver.running() as server,
        psycopg.connect(server.url(), autocommit=True, client_encoding="utf8") as conn,
    ):
        row = conn.execute("SHOW server_version").fetchone()
        load_seconds = load(conn, args.messages, args.dead_letters, args.vacuum)
        timings = time_collect(conn, args.runs, stats.DEFAULT_TOP)
        probe_timings = time_collect(conn, args.runs, 0)
        snapshot = stats.collect(conn)
    print(f"PostgreSQL {row[0] if row else '?'}")
    print(
        f"loaded {args.messages:,} outbox rows and {args.dead_letters:,} dead letters "
        f"in {load_seconds:.1f} s, then {'VACUUM ANALYZE' if args.vacuum else 'ANALYZE'}"
    )
    print(report("stats.collect() (outbox_stats)", timings))
    print(report("stats.collect(top=0) (outbox_stats --top 0)", probe_timings))
    print("snapshot:", snapshot.as_dict())


if __name__ == "__main__":
    main()
