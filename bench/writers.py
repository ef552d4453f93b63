"""Writer concurrency: what each outbox costs the transactions that write to it.

pgbench clients commit one outbox row per transaction (a copy of a real row, fresh task id):
our table with its trigger and our relay running, the same table without the trigger (no
relay: nothing would wake it), and, for reference, the peer's table with its relay running.
The configurations with a relay running run once per broker (the relay, and the broker it
publishes to, compete with the writers for the same cores); the others involve no broker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import db
from bench.brokers import LABELS, REDIS
from bench.procs import BenchError
from bench.services import stat_statements_ready
from bench.sides import MAIN, Side, World, pgbench_script

WRITERS = (1, 8, 32)
SECONDS = 4  # per run; pgbench -T takes whole seconds
QUICK_SECONDS = 1
SETTLE = 0.5  # seconds between a relay being up and pgbench starting
TPS_LINE = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)$", re.MULTILINE)
COUNT_LINE = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)


@dataclass(frozen=True, kw_only=True)
class Config:
    """One way of writing."""

    key: str
    label: str
    side: str
    trigger: bool
    relay: bool
    broker: str | None = None  # the broker its relay publishes to (None: no relay)


BASE_CONFIGS = (
    Config(
        key="ours-no-trigger",
        label="outbox-notify table, trigger dropped, no relay",
        side="ours",
        trigger=False,
        relay=False,
    ),
    Config(
        key="ours-trigger",
        label="outbox-notify table + trigger, no relay",
        side="ours",
        trigger=True,
        relay=False,
    ),
)
RELAY_LABELS = {
    "ours": "outbox-notify table + trigger, relay running",
    "peer": "django-celery-outbox table, relay running",
}


def configs(brokers: list[str]) -> list[Config]:
    """The configurations without a relay, then those with one, for each broker in turn.

    Redis keeps the plain keys `ours` and `peer` (as in reports made before RabbitMQ ran).
    """
    found = list(BASE_CONFIGS)
    for broker in brokers:
        for side, label in RELAY_LABELS.items():
            key = side if broker == REDIS else f"{side}-{broker}"
            found.append(
                Config(
                    key=key, label=f"{label} ({LABELS[broker]})", side=side,
                    trigger=side == "ours", relay=True, broker=broker,
                )
            )  # fmt: skip
    return found


def run(world: World) -> dict[str, Any]:
    """Each configuration in turn (its relay started once), at each writer count."""
    seconds = QUICK_SECONDS if world.quick else SECONDS
    sides = {s.key: s for s in world.sides}
    brokers = {b.key: b for b in world.brokers}
    counting = stat_statements_ready(world.pg)
    rows = []
    # Quick mode keeps the relay-running rows of the first broker only (a smoke run).
    chosen = list(brokers)[:1] if world.quick else list(brokers)
    for config in (c for c in configs(chosen) if c.side in sides):
        side = sides[config.side]
        script = _script(world, side)
        here = world.on(brokers[config.broker]) if config.broker else world
        with _conditions(here, config, side):
            for writers in WRITERS:
                rows.append(
                    measure(
                        here, config, side, script=script, writers=writers, seconds=seconds,
                        counting=counting,
                    )
                )  # fmt: skip
    base = {r["writers"]: r["tps"] for r in rows if r["config"] == "ours-no-trigger"}
    for row in rows:
        row["ratio_to_no_trigger"] = (
            row["tps"] / base[row["writers"]] if base.get(row["writers"]) else None
        )
    return {"seconds": seconds, "writers": list(WRITERS), "brokers": chosen, "rows": rows}


def _script(world: World, side: Side) -> Path:
    path = world.work_dir / f"pgbench-{side.key}.sql"
    path.write_text(pgbench_script(side))
    return path


@contextlib.contextmanager
def _conditions(world: World, config: Config, side: Side) -> Iterator[None]:
    """The configuration's trigger and relay for the block; an empty table after it."""
    db.reset(world, side)
    drop_trigger = side.key == "ours" and not config.trigger
    trigger = db.without_our_trigger(world) if drop_trigger else contextlib.nullcontext()
    try:
        with trigger, _relay(world, side, config.relay):
            yield
    finally:
        db.reset(world, side)


def measure(
    world: World, config: Config, side: Side, *, script: Path, writers: int, seconds: int,
    counting: bool,
) -> dict[str, Any]:  # fmt: skip
    """One pgbench run on an empty table; tps and the share of transactions that notified."""
    db.reset(world, side)
    dbname = MAIN.database(side)
    before = db.notify_calls(world, dbname) if counting else None
    tps, transactions = pgbench(world, side, script, writers, seconds)
    published = world.broker.depth(world.queue(side)) if config.relay else 0
    after = db.notify_calls(world, dbname) if counting else None
    notified = None if before is None or after is None else (after - before) / transactions
    return {
        "config": config.key,
        "label": config.label,
        "broker": config.broker,
        "writers": writers,
        "tps": tps,
        "transactions": transactions,
        "notified_share": notified,
        "published_during_run": published if config.relay else None,
    }


@contextlib.contextmanager
def _relay(world: World, side: Side, wanted: bool) -> Iterator[None]:
    if not wanted:
        yield
        return
    with world.procs.started(lambda: world.start_relays(side, 1)):
        time.sleep(SETTLE)
        yield


def find_pgbench() -> str:
    """pgbench beside the server binaries devtools.pgserver uses, else from PATH."""
    from devtools import pgserver

    with contextlib.suppress(RuntimeError):
        beside = Path(pgserver.find_pg_ctl()).parent / "pgbench"
        if os.access(beside, os.X_OK):
            return str(beside)
    found = shutil.which("pgbench")
    if not found:
        raise BenchError("pgbench is not installed (it comes with the PostgreSQL client tools)")
    return found


def pgbench(
    world: World, side: Side, script: Path, writers: int, seconds: int
) -> tuple[float, int]:
    """(tps, transactions) of one pgbench run."""
    argv = [
        find_pgbench(),
        "-n",
        "-c",
        str(writers),
        "-j",
        str(min(writers, os.cpu_count() or 1)),
        "-T",
        str(seconds),
        "-f",
        str(script),
        world.dsn(side),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=seconds + 120)
    if done.returncode != 0:
        raise BenchError(f"pgbench exited with {done.returncode}: {done.stderr.strip()}")
    tps, count = TPS_LINE.search(done.stdout), COUNT_LINE.search(done.stdout)
    if not tps or not count:
        raise BenchError(f"cannot read pgbench's report:\n{done.stdout}")
    return float(tps.group(1)), int(count.group(1))
