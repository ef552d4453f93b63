"""A steady load through named phases, sampled per interval: what bench.snapshot and bench.soak share.

One producer commits `rate` rows per second (`per_tx` per transaction) for the length of every
phase together; a consumer stamps each message's arrival in the broker; the side's relays
publish. Every `window` seconds the sampler reads the outbox table's size (heap + indexes
+ TOAST), its live and dead rows (pg_stat_user_tables), the relays' CPU seconds and RSS
(/proc/PID/stat, /proc/PID/status), and the CPU of a private PostgreSQL's whole process tree. A phase may hold a REPEATABLE READ snapshot open on
another connection of the same database (a query on the outbox table makes it real) from its
start to its end. After the last phase the relays get `catch_up` seconds to publish what is
left; what they have not published by then counts as not delivered (an infinite latency).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import db
from bench.procs import BenchError, Proc, tree_cpu_seconds, wait_until
from bench.services import connect
from bench.sides import Side, World, one_row_sql

PRODUCER_THREADS = 8
WARMUP = 1.0  # seconds between the relays being up and the first message
TICK = 0.2  # seconds between the sampler's checks of the clock
PAGE = 8192  # bytes per PostgreSQL page
STATS = """
SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid),
       s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.vacuum_count
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = {}::regclass
"""


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One stretch of the run; `hold` keeps an old snapshot open for its whole length."""

    name: str
    seconds: float
    hold: bool = False


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The load, its phases, and how the run is sampled and bounded."""

    phases: tuple[Phase, ...]
    rate: int  # rows per second
    per_tx: int  # rows per transaction
    window: float  # seconds per sampled interval
    batch_size: int  # our relay's --batch-size (the peer keeps its defaults)
    catch_up: float  # seconds the relays get to publish the rest after the last phase

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


def relay_rss(pid: int) -> int:
    """Resident set of a process in bytes; 0 once it is gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def table_stats(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    row = conn.execute(sql.SQL(STATS).format(sql.Literal(table))).fetchone()
    assert row is not None
    keys = ("total_bytes", "heap_bytes", "live_rows", "dead_rows", "autovacuums", "vacuums")
    return {k: int(v or 0) for k, v in zip(keys, row, strict=True)}


@contextlib.contextmanager
def old_snapshot(dsn: str, table: str) -> Iterator[None]:
    """A REPEATABLE READ transaction that read the table, open for the block."""
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
        try:
            yield
        finally:
            conn.rollback()


class Sampler:
    """Samples of the table and the relays, stamped in monotonic ns."""

    def __init__(self, world: World, side: Side, relays: list[Proc]) -> None:
        self.conn = connect(world.dsn(side))
        self.table = side.table
        self.relays = relays
        self.server = world.pg.postmaster_pid()  # None for a server the benchmark did not start
        self.samples: list[dict[str, Any]] = []

    def take(self, phase: str) -> dict[str, Any]:
        sample = {
            "t_ns": time.monotonic_ns(),
            "phase": phase,
            **table_stats(self.conn, self.table),
            "relay_cpu_s": round(sum(r.cpu() for r in self.relays), 3),
            "relay_rss_bytes": sum(relay_rss(r.pid) for r in self.relays),
            "relays_alive": sum(1 for r in self.relays if r.alive()),
            "server_cpu_s": None
            if self.server is None
            else round(tree_cpu_seconds(self.server), 3),
        }
        self.samples.append(sample)
        return sample

    def close(self) -> None:
        self.conn.close()


def run(world: World, side: Side, relays: int, plan: Plan) -> dict[str, Any]:
    """One side with `relays` relays through every phase of the plan: the raw figures."""
    db.reset(world, side)
    tag = f"{side.key}-{relays}-{world.broker.key}"
    sql_file = world.work_dir / f"sustained-insert-{side.key}.sql"
    sql_file.write_text(one_row_sql(side))
    arrivals_file = world.work_dir / f"sustained-arrivals-{tag}.json"
    produced_file = world.work_dir / f"sustained-produced-{tag}.json"
    args = ["consume", "--ids-only", "--url", world.broker.url, "--queue", world.queue(side),
            "--out", str(arrivals_file)]  # fmt: skip
    consumer = world.worker(f"consume-{tag}", args)
    consumer.wait_for_output("consumer.ready")
    try:
        with world.procs.started(lambda: _start_relays(world, side, relays, plan)) as procs:
            time.sleep(WARMUP)
            marks, samples, not_drained = _load(world, side, procs, plan, (sql_file, produced_file))
    finally:
        world.procs.stop(consumer)
    produced = json.loads(produced_file.read_text())
    arrivals = json.loads(arrivals_file.read_text())["arrivals"]
    return {
        "side": side.key,
        "relays": relays,
        "marks": marks,
        "samples": samples,
        "left_in_table": not_drained,
        "records": produced["records"],
        "arrivals": arrivals,
    }


def _start_relays(world: World, side: Side, count: int, plan: Plan) -> list[Proc]:
    flags = ["--batch-size", str(plan.batch_size)] if side.key == "ours" else []
    argv = [sys.executable, "-m", "django", *side.command, *flags]
    started = [world.procs.start(f"relay-{side.key}-{i}", argv, world.env()) for i in range(count)]
    for relay in started:
        relay.wait_for_output(side.ready_marker)
    return started


def _load(
    world: World, side: Side, relays: list[Proc], plan: Plan, files: tuple[Path, Path]
) -> tuple[dict[str, int], list[dict[str, Any]], int]:
    """Produce through the phases while sampling; phase boundaries in monotonic ns."""
    sql_file, out = files
    args = ["produce", "--dsn", world.dsn(side), "--sql", str(sql_file), "--out", str(out),
            "--rate", str(plan.rate), "--seconds", str(plan.seconds),
            "--per-tx", str(plan.per_tx), "--threads", str(PRODUCER_THREADS)]  # fmt: skip
    sampler = Sampler(world, side, relays)
    producer = world.worker(f"produce-{side.key}", args)
    marks = {"start": time.monotonic_ns()}
    try:
        sampler.take("start")
        for phase in plan.phases:
            with old_snapshot(world.dsn(side), side.table) if phase.hold else _nothing():
                marks[phase.name] = time.monotonic_ns()
                _sample_for(sampler, phase, plan.window)
        marks["end"] = time.monotonic_ns()
        status = producer.popen.wait(60)
        if status != 0:
            raise BenchError(f"the producer failed ({status}):\n{producer.tail()}")
        left = _catch_up(world, side, plan.catch_up)
        marks["drained"] = time.monotonic_ns()
        sampler.take("after")
        if side.key == "ours":  # what an operator's cron does after such an incident
            _reindex(world, side)
            sampler.take("reindexed")
        return marks, sampler.samples, left
    finally:
        world.procs.stop(producer)
        sampler.close()


def _reindex(world: World, side: Side) -> None:
    """`manage.py outbox_reindex`: the indexes give back what the dead rows made them grow."""
    argv = [sys.executable, "-m", "django", "outbox_reindex", "--min-size", "0"]
    done = subprocess.run(
        argv, env=world.env(), capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"outbox_reindex failed ({done.returncode}):\n{done.stderr}")


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _sample_for(sampler: Sampler, phase: Phase, window: float) -> None:
    """Sample every `window` seconds until the phase ends (and once at its end)."""
    ends = time.monotonic() + phase.seconds
    next_sample = time.monotonic() + window
    while (now := time.monotonic()) < ends:
        if now >= next_sample:
            sampler.take(phase.name)
            next_sample += window
        time.sleep(min(TICK, max(0.0, ends - now)))
    sampler.take(phase.name)


def _catch_up(world: World, side: Side, cap: float) -> int:
    """Wait up to `cap` s for the table and the queue to empty; the rows still in the table."""
    with world.broker.depth_of(world.queue(side)) as depth, contextlib.suppress(BenchError):
        wait_until(lambda: db.count(world, side) == 0 and depth() == 0, cap, "", 0.2)
    time.sleep(0.3)  # the consumer stamps what it took before it is stopped
    return db.count(world, side)


# --- figures -------------------------------------------------------------------------------


def percentile(ordered: list[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for an empty list or a message never delivered."""
    if not ordered:
        return None
    value = ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]
    return None if math.isinf(value) else round(value, 2)


def latencies(raw: dict[str, Any]) -> list[tuple[int, float]]:
    """(commit ns, commit -> broker ms) of every message; math.inf when it never arrived."""
    arrivals = raw["arrivals"]
    return [
        (committed, (arrivals[tid] - committed) / 1e6 if tid in arrivals else math.inf)
        for tid, _due, committed in raw["records"]
    ]


def windows(raw: dict[str, Any], window: float) -> list[dict[str, Any]]:
    """Per interval of commit time: p50/p99, messages, then the sample closest to its end."""
    start = raw["marks"]["start"]
    step = int(window * 1e9)
    buckets: dict[int, list[float]] = {}
    for committed, ms in latencies(raw):
        buckets.setdefault((committed - start) // step, []).append(ms)
    rows = []
    for index in sorted(buckets):
        ordered = sorted(buckets[index])
        end_ns = start + (index + 1) * step
        sample = min(raw["samples"], key=lambda s: abs(s["t_ns"] - end_ns))
        rows.append({
            "t_s": round((index + 1) * window, 1),
            "phase": phase_at(raw["marks"], start + index * step + step // 2),
            "messages": len(ordered),
            "missing": sum(1 for v in ordered if math.isinf(v)),
            "p50_ms": percentile(ordered, 50),
            "p99_ms": percentile(ordered, 99),
            "total_bytes": sample["total_bytes"],
            "dead_rows": sample["dead_rows"],
            "live_rows": sample["live_rows"],
            "relay_rss_bytes": sample["relay_rss_bytes"],
        })  # fmt: skip
    return rows


def phase_at(marks: dict[str, int], t_ns: int) -> str:
    """The phase a moment falls in ("after" once the last phase ended)."""
    found = "start"
    for name, stamp in marks.items():
        if name in ("start", "drained"):
            continue
        if t_ns >= stamp:
            found = "after" if name == "end" else name
    return found


def phases(raw: dict[str, Any], plan: Plan) -> dict[str, dict[str, Any]]:
    """Per phase: p50/p99 of the messages committed in it, CPU per message published in it."""
    marks = raw["marks"]
    names = [p.name for p in plan.phases]
    bounds = dict(zip(names, [*(marks[n] for n in names[1:]), marks["end"]], strict=True))
    by_phase: dict[str, list[float]] = {n: [] for n in names}
    for committed, ms in latencies(raw):
        name = phase_at(marks, committed)
        by_phase.setdefault(name, []).append(ms)
    lags: dict[str, list[float]] = {n: [] for n in names}
    for _tid, due, committed in raw["records"]:
        lags.setdefault(phase_at(marks, committed), []).append((committed - due) / 1e6)
    arrived = sorted(raw["arrivals"].values())
    result = {}
    for name in names:
        begin, end = marks[name], bounds[name]
        ordered = sorted(by_phase[name])
        published = _count_between(arrived, begin, end)
        at_begin, at_end = _sample_at(raw, begin), _sample_at(raw, end)
        cpu = at_end["relay_cpu_s"] - at_begin["relay_cpu_s"]
        server = _delta(at_begin.get("server_cpu_s"), at_end.get("server_cpu_s"))
        result[name] = {
            "seconds": round((end - begin) / 1e9, 1),
            "messages": len(ordered),
            "missing": sum(1 for v in ordered if math.isinf(v)),
            "published": published,
            "p50_ms": percentile(ordered, 50),
            "p99_ms": percentile(ordered, 99),
            "producer_lag_p99_ms": percentile(sorted(lags[name]), 99),
            "relay_cpu_s": round(cpu, 2),
            "cpu_ms_per_msg": round(cpu * 1000 / published, 4) if published else None,
            "server_cpu_ms_per_msg": (
                round(server * 1000 / published, 4) if published and server is not None else None
            ),
            "end_total_bytes": at_end["total_bytes"],
            "end_dead_rows": at_end["dead_rows"],
            "max_total_bytes": max(
                s["total_bytes"] for s in raw["samples"] if begin <= s["t_ns"] <= end
            ),
            "relay_rss_bytes": at_end["relay_rss_bytes"],
        }
    return result


def _count_between(ordered: list[int], begin: int, end: int) -> int:
    return bisect.bisect_left(ordered, end) - bisect.bisect_left(ordered, begin)


def _delta(begin: float | None, end: float | None) -> float | None:
    return None if begin is None or end is None else end - begin


def _sample_at(raw: dict[str, Any], t_ns: int) -> dict[str, Any]:
    sample: dict[str, Any] = min(raw["samples"], key=lambda s: abs(s["t_ns"] - t_ns))
    return sample


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None
