"""Latency: commit-return to arrival in the broker, one message per transaction at fixed rates.

A producer process commits rows at a fixed rate from several connections (so the rate does not
depend on one connection's fsync wait) and stamps each commit's return; a consumer process
takes each message off the broker as it arrives (Redis: BRPOP on the list; RabbitMQ: a
basic.consume on the queue) and stamps it. Both stamps are CLOCK_MONOTONIC. Per round, each
library in turn gets one relay that lives through all the rates.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from bench import db
from bench.procs import BenchError, Proc, wait_until
from bench.sides import Side, World, one_row_sql

RATES = (50, 500, 2000)  # messages per second
QUICK_RATES = (50, 500)
SECONDS = 5.0  # per rate
QUICK_SECONDS = 3.0
ROUNDS = 2
QUICK_ROUNDS = 1
PRODUCER_THREADS = 8
WARMUP = 1.0  # seconds between a relay being up and the first message
SETTLE = 0.3  # seconds between rates
# Seconds a relay that fell behind may take to catch up once the producer stops; what it has
# not published by then counts as not delivered (an infinite latency in the percentiles).
CATCH_UP = 8.0
LAST_CATCH_UP = 5.0  # after the last rate the relay is stopped and the table emptied
QUICK_CATCH_UP = 8.0
QUICK_LAST_CATCH_UP = 5.0
CDF_POINTS = 200


def run(world: World) -> dict[str, Any]:
    """Every rate for every library, libraries alternating inside each round."""
    rates = QUICK_RATES if world.quick else RATES
    seconds = QUICK_SECONDS if world.quick else SECONDS
    rounds = QUICK_ROUNDS if world.quick else ROUNDS
    latencies: dict[tuple[str, int], list[float]] = {}
    runs: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        for side in world.sides:
            for rate, result in one_round(world, side, rates, seconds).items():
                latencies.setdefault((side.key, rate), []).extend(result.pop("latencies_ms"))
                runs.append({"round": rnd, "side": side.key, "rate": rate, **result})
    rows = [
        summary(side.key, rate, latencies[side.key, rate], runs)
        for rate in rates
        for side in world.sides
    ]
    return {
        "broker": world.broker.key,
        "rates": list(rates),
        "seconds": seconds,
        "rounds": rounds,
        "rows": rows,
        "runs": runs,
    }


def one_round(world: World, side: Side, rates: tuple[int, ...], seconds: float) -> dict[int, Any]:
    """One relay and one consumer for all the rates of one library."""
    db.reset(world, side)
    sql_file = world.work_dir / f"insert-{side.key}.sql"
    sql_file.write_text(one_row_sql(side))
    arrivals_file = world.work_dir / f"arrivals-{side.key}-{world.broker.key}.json"
    consumer = start_consumer(world, side, arrivals_file)
    produced: dict[int, dict[str, Any]] = {}
    try:
        with world.procs.started(lambda: world.start_relays(side, 1)):
            time.sleep(WARMUP)
            for rate in rates:
                catch_up = catch_up_cap(world, last=rate == rates[-1])
                produced[rate] = produce(world, side, sql_file, (rate, seconds), catch_up)
                time.sleep(SETTLE)
    finally:
        world.procs.stop(consumer)
    consumed = json.loads(arrivals_file.read_text())
    return {rate: match(out, consumed) for rate, out in produced.items()}


def start_consumer(world: World, side: Side, out: Path) -> Proc:
    args = ["consume", "--url", world.broker.url, "--queue", world.queue(side), "--out", str(out)]
    consumer = world.worker(f"consume-{side.key}", args)
    consumer.wait_for_output("consumer.ready")
    return consumer


def catch_up_cap(world: World, *, last: bool) -> float:
    """Seconds to wait for a relay that fell behind the producer (see summary())."""
    if world.quick:
        return QUICK_LAST_CATCH_UP if last else QUICK_CATCH_UP
    return LAST_CATCH_UP if last else CATCH_UP


def produce(
    world: World, side: Side, sql_file: Path, load: tuple[int, float], catch_up: float
) -> dict[str, Any]:
    """Run the producer at one rate, then give the relay up to `catch_up` s to publish it all."""
    rate, seconds = load
    out = world.work_dir / f"produced-{side.key}-{world.broker.key}-{rate}.json"
    args = ["produce", "--dsn", world.dsn(side), "--sql", str(sql_file), "--out", str(out),
            "--rate", str(rate), "--seconds", str(seconds), "--threads", str(PRODUCER_THREADS)]  # fmt: skip
    producer = world.worker(f"produce-{side.key}-{rate}", args)
    status = producer.popen.wait(seconds + 60)
    world.procs.stop(producer)
    if status != 0:
        raise BenchError(f"the producer failed ({status}):\n{producer.tail()}")
    with (
        world.broker.depth_of(world.queue(side)) as depth,
        contextlib.suppress(BenchError),  # still behind: counted as not delivered
    ):
        wait_until(lambda: db.count(world, side) == 0 and depth() == 0, catch_up, "")
    time.sleep(BRPOP_SLACK)
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


BRPOP_SLACK = 0.1  # seconds: the consumer stamps what it took before we stop it


def match(produced: dict[str, Any], consumed: dict[str, Any]) -> dict[str, Any]:
    """Latencies (ms) of every message sent; math.inf for one that never arrived."""
    arrivals = consumed["arrivals"]
    records = produced["records"]
    latencies = [
        (arrivals[tid] - committed) / 1e6 if tid in arrivals else math.inf
        for tid, _due, committed in records
    ]
    behind = [(committed - due) / 1e6 for _tid, due, committed in records]
    return {
        "sent": len(records),
        "achieved_rate": len(records) / produced["seconds"] if produced["seconds"] else 0.0,
        "missing": sum(1 for t in records if t[0] not in arrivals),
        "producer_lag_p99_ms": percentile(sorted(behind), 99) if behind else None,
        "p50_ms": _finite(percentile(sorted(latencies), 50)) if latencies else None,
        "latencies_ms": latencies,
    }


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def _finite(value: float) -> float | None:
    """None stands for 'not delivered' in the JSON (which has no infinity)."""
    return None if math.isinf(value) else value


def summary(
    side: str, rate: int, values: list[float], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Percentiles over every round (undelivered messages count as infinitely late), the CDF."""
    ordered = sorted(values)
    mine = [r for r in runs if r["side"] == side and r["rate"] == rate]
    row: dict[str, Any] = {
        "side": side,
        "rate": rate,
        "messages": len(ordered),
        "missing": sum(r["missing"] for r in mine),
        "achieved_rate": sum(r["achieved_rate"] for r in mine) / len(mine),
        "round_p50_ms": [r["p50_ms"] for r in mine],
    }
    if not ordered:
        return row
    for pct in (50, 90, 99):
        row[f"p{pct}_ms"] = _finite(percentile(ordered, pct))
    row["max_ms"] = _finite(ordered[-1])
    points = (percentile(ordered, 100 * (i + 1) / CDF_POINTS) for i in range(CDF_POINTS))
    row["cdf_ms"] = [_finite(p) for p in points]
    return row
