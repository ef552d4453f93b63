"""Tasks held until their ETA: how late they are published, and what a million cost the drain.

Run: .venv/bin/python -m bench.held [--rows 500] [--spread 10] [--held 1000000]
                                     [--drain 30000] [--rounds 3] [--burst 10000]
                                     [--quick] [--json PATH]

`make bench` runs it with the defaults, `make bench-quick` with --quick (200 rows over 5 s,
100,000 held rows, one round of 5,000, the same 10,000-row burst); --json writes the figures.

Starts a private PostgreSQL with sql/install.sql and one real `outbox_listen` (60 s sweep
interval, so only its due-time timer can publish a held row on time) publishing to Redis
(OUTBOX_BENCH_REDIS_URL, default redis://127.0.0.1:6379/12), then prints:

1. lateness: --rows held rows whose ETAs fall at random moments over --spread seconds;
   lateness = arrival in Redis (BRPOP here) - ETA, p50/p99/max in ms, and how many arrived
   before their ETA (must be 0).
2. drain: --drain ready rows committed at once while the relay sleeps, time until the last is
   in Redis, as messages/s: with an empty table and beside --held held rows (due tomorrow),
   alternated over --rounds rounds; the claim's plan beside the held rows, and what the claim
   of releases before holding costs there.
3. burst: --burst held rows all due in the same second; time from that second until the
   last is in Redis.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis

from devtools import pgserver
from outbox_notify import sql
from outbox_notify.relay.frontier import Frontier
from outbox_notify.serialization import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
QUEUE = "outbox-bench-held"
# The claim of the releases before holding (sql/queries.sql at 737228a).
OLD_CLAIM = """
SELECT id FROM outbox_notify_message_v1
WHERE (retry_after IS NULL OR retry_after <= now()) AND schema_version <= 1
ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED
"""
# Rows written by SQL, one statement per batch: the options of a Celery message with an eta.
INSERT_ROWS = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version, retry_after)
SELECT %(prefix)s::text || g, 'bench.noop', '[]', '{}',
       json_build_object(
           'headers', json_build_object(
               'lang', 'py', 'task', 'bench.noop', 'id', %(prefix)s::text || g, 'retries', 0,
               'root_id', %(prefix)s::text || g,
               'eta', to_char(to_timestamp((%(eta)s::float8[])[g]) AT TIME ZONE 'UTC',
                              'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')),
           'properties', json_build_object('correlation_id', %(prefix)s::text || g),
           'embed', json_build_object('callbacks', null, 'errbacks', null, 'chain', null,
                                      'chord', null),
           'exchange', '', 'routing_key', %(queue)s::text, 'serializer', 'json',
           'delivery_mode', 2, 'declare', json_build_array(), 'relative', json_build_object()),
       1, to_timestamp((%(eta)s::float8[])[g])
FROM generate_series(1, cardinality(%(eta)s::float8[])) AS g
"""
READY_ROWS = """
INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, schema_version)
SELECT 'ready-' || %(round)s::text || '-' || g, 'bench.noop', '[]', '{}',
       json_build_object(
           'headers', json_build_object('lang', 'py', 'task', 'bench.noop',
                                        'id', 'ready-' || g, 'retries', 0),
           'properties', json_build_object(), 'embed', json_build_object(),
           'exchange', '', 'routing_key', %(queue)s::text, 'serializer', 'json',
           'delivery_mode', 2, 'declare', json_build_array(), 'relative', json_build_object()),
       1
FROM generate_series(1, %(rows)s) AS g
"""
HELD_TOMORROW = """
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, schema_version, retry_after)
SELECT 'tomorrow-' || g, 'bench.noop', '[]', '{}', '{"headers": {}}', 1,
       now() + interval '1 day' + g * interval '10 ms'
FROM generate_series(1, %(rows)s) AS g
"""


def _insert_held(url: str, etas: list[float], prefix: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(INSERT_ROWS, {"prefix": prefix, "eta": etas, "queue": QUEUE})


@contextmanager
def _relay(url: str) -> Iterator[subprocess.Popen[bytes]]:
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", OUTBOX_TEST_DATABASE_URL=url)
    env.update(
        OUTBOX_TEST_DB_NAME="postgres", OUTBOX_TEST_BROKER_URL=REDIS_URL, PYTHONPATH=str(ROOT)
    )
    command = ["outbox_listen", "--sweep-interval", "60", "--stale-timeout", "120"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2.0)  # connected, swept, asleep
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100)
    return {
        "p50_ms": round(q[49], 1),
        "p99_ms": round(q[98], 1),
        "max_ms": round(ordered[-1], 1),
        "min_ms": round(ordered[0], 1),
    }


def lateness(url: str, client: redis.Redis, rows: int, spread: float) -> dict[str, Any]:
    """Held rows due at random moments: arrival - ETA."""
    now = time.time()
    etas = [now + 2.0 + random.uniform(0, spread) for _ in range(rows)]
    _insert_held(url, etas, "held-")
    due = {f"held-{n + 1}": eta for n, eta in enumerate(etas)}
    late: list[float] = []
    deadline = time.monotonic() + spread + 60
    while len(late) < rows and time.monotonic() < deadline:
        item = client.brpop([QUEUE], timeout=1)
        if item is not None:
            arrived = time.time()
            late.append((arrived - due[json.loads(item[1])["headers"]["id"]]) * 1000)
    if len(late) < rows:
        raise SystemExit(f"only {len(late)} of {rows} held tasks arrived")
    figures = {"rows": rows, "spread_s": spread, **_quantiles(late)}
    figures["early"] = sum(1 for value in late if value < 0)
    print(
        f"lateness of {rows} held tasks (ms): p50 {figures['p50_ms']}  p99 {figures['p99_ms']}  "
        f"max {figures['max_ms']}  min {figures['min_ms']}  published early: {figures['early']}"
    )
    return figures


def _drain_once(url: str, client: redis.Redis, rows: int, round_no: int) -> float:
    client.delete(QUEUE)
    with psycopg.connect(url) as conn:
        conn.execute(READY_ROWS, {"rows": rows, "queue": QUEUE, "round": round_no})
        conn.commit()
        started = time.monotonic()
    while client.llen(QUEUE) < rows:
        if time.monotonic() - started > 300:
            raise SystemExit("the drain did not finish in 300 s")
        time.sleep(0.002)
    seconds = time.monotonic() - started
    client.delete(QUEUE)
    return rows / seconds


def _set_held(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_notify_message_v1 WHERE task_id LIKE 'tomorrow-%'")
        if rows:
            conn.execute(HELD_TOMORROW, {"rows": rows})
        conn.execute("VACUUM ANALYZE outbox_notify_message_v1")


def drain(url: str, client: redis.Redis, rows: int, held: int, rounds: int) -> dict[str, Any]:
    """Drain rate of ready rows with an empty table and beside `held` held rows."""
    rates: dict[int, list[float]] = {0: [], held: []}
    _drain_once(url, client, rows, -1)  # warm-up: connections, caches, the queue's first use
    for round_no in range(rounds):
        for beside in (0, held) if round_no % 2 == 0 else (held, 0):
            _set_held(url, beside)
            rates[beside].append(_drain_once(url, client, rows, round_no))
    alone, beside = statistics.median(rates[0]), statistics.median(rates[held])
    print(
        f"drain of {rows} ready rows (msg/s, median of {rounds}): empty table {alone:,.0f}  "
        f"beside {held:,} held rows {beside:,.0f}  ({(beside / alone - 1) * 100:+.1f} %)"
    )
    runs = {k: [round(r) for r in v] for k, v in rates.items()}
    print("  runs:", runs)
    return {
        "rows": rows,
        "held": held,
        "rounds": rounds,
        "empty_msg_s": round(alone),
        "beside_msg_s": round(beside),
        "change_pct": round((beside / alone - 1) * 100, 1),
        "runs": {"empty": runs[0], "beside": runs[held]},
        "plans": _plans(url, held),
    }


def _plans(url: str, held: int) -> dict[str, list[str]]:
    # The ready rows stay uncommitted, so the running relay never sees them.
    # A new relay's frontier: the claim reads the ready rows from the start of the table.
    params = {**Frontier().params(), "limit": 100, "max_version": SCHEMA_VERSION}
    plans: dict[str, list[str]] = {}
    new = sql.queries()["claim_batch"]
    for name, query in (("claim_batch", new), ("claim of earlier releases", OLD_CLAIM)):
        with psycopg.connect(url) as conn:
            conn.execute(READY_ROWS, {"rows": 1000, "queue": QUEUE, "round": "plan"})
            conn.execute("ANALYZE outbox_notify_message_v1")
            if query is new:  # in the transaction's settings the relay claims with
                conn.execute(sql.queries()["set_claim_timeout"], {"timeout_ms": "30000"})
            plan = conn.execute(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) " + query, params
            ).fetchall()
            conn.rollback()
        plans[name] = [str(line) for (line,) in plan]
        print(f"  plan of the {name} beside {held:,} held rows and 1,000 ready:")
        for line in plans[name]:
            print("    " + line)
    return plans


def burst(url: str, client: redis.Redis, rows: int) -> dict[str, Any]:
    """`rows` held rows due in the same second: time from that second to the last arrival."""
    client.delete(QUEUE)
    second = float(int(time.time()) + 4)
    etas = sorted(second + random.uniform(0, 0.999) for _ in range(rows))
    _insert_held(url, etas, "burst-")
    while client.llen(QUEUE) < rows:
        if time.time() - second > 120:
            raise SystemExit(f"only {client.llen(QUEUE)} of {rows} burst rows arrived")
        time.sleep(0.001)
    done = time.time()
    early = _published_before(client, {f"burst-{n + 1}": eta for n, eta in enumerate(etas)})
    figures = {
        "rows": rows,
        "after_second_ms": round((done - second) * 1000),
        "after_last_eta_ms": round((done - etas[-1]) * 1000),
        "out_of_eta_order": early,
    }
    print(
        f"burst of {rows:,} held rows due within one second: all published "
        f"{figures['after_second_ms']} ms after that second began, "
        f"{figures['after_last_eta_ms']} ms after the last ETA; out of ETA order: {early}"
    )
    client.delete(QUEUE)
    return figures


def _published_before(client: redis.Redis, due: dict[str, float]) -> int:
    """How many messages sit in the queue ahead of one with an earlier ETA (claims go by ETA)."""
    raw = client.lrange(QUEUE, 0, -1)
    etas = [due[json.loads(item)["headers"]["id"]] for item in reversed(raw)]
    return sum(1 for a, b in itertools.pairwise(etas) if b < a)


def markdown(figures: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures."""
    late, burst_, drained = figures["lateness"], figures["burst"], figures["drain"]
    lines = [
        "Tasks held in the outbox until their ETA (issue 15), one relay publishing to Redis "
        "(`python -m bench.held`).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| lateness of {late['rows']} held tasks due over {late['spread_s']:g} s "
        f"(arrival in Redis - ETA) | p50 {late['p50_ms']} ms, p99 {late['p99_ms']} ms, "
        f"max {late['max_ms']} ms; published before their ETA: {late['early']} |",
        f"| {burst_['rows']:,} held rows due within one second | all published "
        f"{burst_['after_second_ms']:,} ms after that second began "
        f"({burst_['after_last_eta_ms']:,} ms after the last ETA); out of ETA order: "
        f"{burst_['out_of_eta_order']} |",
        f"| drain of {drained['rows']:,} ready rows, median of {drained['rounds']} | empty "
        f"table {drained['empty_msg_s']:,} msg/s; beside {drained['held']:,} held rows "
        f"{drained['beside_msg_s']:,} msg/s ({drained['change_pct']:+.1f} %) |",
        "",
        f"Plan of `claim_batch` beside {drained['held']:,} held rows and 1,000 ready:",
        "",
        "```",
        *drained["plans"].get("claim_batch", []),
        "```",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure and print held-task lateness, drain beside held rows, and a due burst."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=500, help="held rows for lateness")
    parser.add_argument("--spread", type=float, default=10.0, help="seconds their ETAs span")
    parser.add_argument("--held", type=int, default=1_000_000, help="held rows beside the drain")
    parser.add_argument("--drain", type=int, default=30_000, help="ready rows per drain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="a short run (see above)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.spread, args.held, args.drain, args.rounds = 200, 5.0, 100_000, 5_000, 1
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(QUEUE)
    print("(figures from a shared machine are indicative: re-measure on a quiet one)")
    try:
        with pgserver.running() as server:
            url = server.url()
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.read("install.sql"))
            with _relay(url):
                figures = {
                    "lateness": lateness(url, client, args.rows, args.spread),
                    "burst": burst(url, client, args.burst),
                    "drain": drain(url, client, args.drain, args.held, args.rounds),
                }
    finally:
        client.delete(QUEUE)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
