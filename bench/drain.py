"""Drain throughput: a committed backlog published by 1 and by 2 relays, to one broker.

The relays start on an empty table and settle; the backlog is inserted in one transaction and
the clock starts when its commit returns. It stops when the broker's queue holds every message
(the Redis list's length; the RabbitMQ queue's ready messages). CPU comes from /proc: utime +
stime of the relay processes, of the PostgreSQL server's whole process tree when the server
is a private one (its reaped backends included), and of the broker's server process when it
is a private one (redis-server; RabbitMQ's beam.smp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import db
from bench.procs import BenchError, Proc, tree_cpu_seconds
from bench.sides import Side, World

BACKLOG = 100_000
QUICK_BACKLOG = 10_000
RELAY_COUNTS = (1, 2)
SETTLE = 1.0  # seconds between the relays being up and the commit
QUICK_SETTLE = 0.3
CAP = 30.0  # seconds one drain may take; a slower one reports its rate over the cap
QUICK_CAP = 6.0
DEPTH_POLL = 0.01  # seconds between two reads of the queue's depth
PROFILE_BACKLOG = 30_000
PROFILE_RATE = 250  # py-spy samples per second
# On RabbitMQ our relays drain again at a larger --batch-size (docs/deploy.md, "Batch size"):
# each batch waits once for its confirms, so there the batch size sets the rate.
AMQP_BATCH = 2_000


def run(world: World) -> dict[str, Any]:
    """1 relay for each library in turn, then 2 relays for each library in turn; on RabbitMQ
    then ours again, 1 and 2 relays, at AMQP_BATCH."""
    backlog = QUICK_BACKLOG if world.quick else BACKLOG
    rows = [
        one_drain(world, side, relays, backlog) for relays in RELAY_COUNTS for side in world.sides
    ]
    if world.broker.key == "rabbitmq":
        ours = next((side for side in world.sides if side.key == "ours"), None)
        if ours is not None:
            larger = dataclasses.replace(
                ours, command=(*ours.command, "--batch-size", str(AMQP_BATCH))
            )
            rows += [
                one_drain(world, larger, relays, backlog, batch_size=AMQP_BATCH)
                for relays in RELAY_COUNTS
            ]
    return {
        "broker": world.broker.key,
        "backlog": backlog,
        "cap_s": QUICK_CAP if world.quick else CAP,
        "rows": rows,
        "postgres_cpu": world.pg.private,
        "broker_cpu": world.broker.pid is not None,
    }


@dataclass(frozen=True, kw_only=True)
class Cpu:
    """CPU seconds used so far: relays, PostgreSQL and the broker (None: not ours to read)."""

    relays: float
    pg: float | None
    broker: float | None


def _cpu(relays: list[Proc], world: World) -> Cpu:
    postmaster = world.pg.postmaster_pid()
    return Cpu(
        relays=sum(r.cpu() for r in relays),
        pg=tree_cpu_seconds(postmaster) if postmaster else None,
        broker=world.broker.cpu(),
    )


def _per_message(before: float | None, after: float | None, count: int) -> float | None:
    """Microseconds per message between two CPU readings; None when either is missing."""
    if before is None or after is None:
        return None
    return (after - before) / count * 1e6


def one_drain(
    world: World, side: Side, count: int, backlog: int, *, batch_size: int | None = None
) -> dict[str, Any]:
    """Time one backlog through `count` relays of one library; `batch_size` is recorded for
    a relay started with a --batch-size other than its default (None)."""
    db.reset(world, side)
    # SIGKILL at the end: after a capped drain, a graceful stop would first drain the rest
    # (django-celery-outbox keeps publishing for up to its 30 s shutdown timeout).
    with world.procs.started(lambda: world.start_relays(side, count), signal.SIGKILL) as relays:
        time.sleep(QUICK_SETTLE if world.quick else SETTLE)
        timing = timed_drain(world, side, relays, backlog)
    db.reset(world, side)
    return {"side": side.key, "relays": count, "batch_size": batch_size, **timing}


def _poll_depth(depth: Callable[[], int], target: int, deadline: float) -> tuple[float, float]:
    """Read the depth until it reaches target or the deadline; (first arrival, last read) times."""
    first = None
    while True:
        length = depth()
        now = time.monotonic()
        if length and first is None:
            first = now
        if length >= target or now >= deadline:
            return (first or now), now
        time.sleep(DEPTH_POLL)


def timed_drain(world: World, side: Side, relays: list[Proc], backlog: int) -> dict[str, Any]:
    """Commit the backlog, wait until the broker has it all (or the cap); rate, CPU per message."""
    cap = QUICK_CAP if world.quick else CAP
    pending = db.PendingFill(world, side, backlog)
    with world.broker.depth_of(world.queue(side)) as depth:
        try:
            before = _cpu(relays, world)
            committed = pending.commit()
        finally:
            pending.close()
        first, done = _poll_depth(depth, backlog, committed + cap)
        after = _cpu(relays, world)
        for relay in relays:
            if not relay.alive():
                raise BenchError(f"{relay.name} died during the drain:\n{relay.tail()}")
        published = depth()
    counted = min(published, backlog)
    if not counted:
        raise BenchError(f"{side.label} published nothing in {cap:.0f} s")
    seconds = done - committed
    return {
        "backlog": backlog,
        "complete": published >= backlog,
        "published": counted,
        "seconds": seconds,
        "per_s": counted / seconds,
        "first_after_s": first - committed,
        "relay_cpu_us_per_msg": (after.relays - before.relays) / counted * 1e6,
        "pg_cpu_us_per_msg": _per_message(before.pg, after.pg, counted),
        "broker_cpu_us_per_msg": _per_message(before.broker, after.broker, counted),
        "duplicates": max(0, published - backlog),
    }


# --- profile ----------------------------------------------------------------------------


def profile(world: World, side: Side, out_dir: Path) -> dict[str, Any]:
    """One extra drain of our relay with py-spy attached: where the relay's time goes."""
    backlog = QUICK_BACKLOG if world.quick else PROFILE_BACKLOG
    raw = out_dir / f"relay-profile-{world.broker.key}.txt"
    db.reset(world, side)
    with world.procs.started(lambda: world.start_relays(side, 1), signal.SIGKILL) as relays:
        time.sleep(SETTLE)
        with py_spy(relays[0], raw):
            timing = timed_drain(world, side, relays, backlog)
    db.reset(world, side)
    return {
        "broker": world.broker.key,
        "drain_under_profiler": timing,
        **summarise_profile(raw),
    }


@contextlib.contextmanager
def py_spy(relay: Proc, out: Path) -> Iterator[None]:
    """py-spy recording the relay (idle samples included) for the length of the block."""
    argv = [
        "py-spy",
        "record",
        "--pid",
        str(relay.pid),
        "--rate",
        str(PROFILE_RATE),
        "--format",
        "raw",
        "--idle",
        "--nonblocking",
        "--output",
        str(out),
    ]
    spy = subprocess.Popen(_venv_bin(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()


def _venv_bin(argv: list[str]) -> list[str]:
    import shutil
    import sys

    beside = Path(sys.executable).parent / argv[0]
    found = str(beside) if beside.exists() else shutil.which(argv[0])
    if not found:
        raise BenchError("py-spy is not installed in the benchmark venv")
    return [found, *argv[1:]]


DRAIN_FRAME = "Relay.drain"  # samples without it on the stack are the relay waiting for work


def _frame(frame: str) -> tuple[str, str]:
    """'function (pkg/module.py:123)' -> ('function (module.py)', 'pkg')."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").split(":", 1)[0]
    module = path.rsplit("/", 1)[-1]
    package = path.split("/", 1)[0].removesuffix(".py") if path else "?"
    return (f"{name} ({module})" if module else name), package


def _drain_stacks(raw: Path) -> list[tuple[list[tuple[str, str]], int]]:
    """(frames below Relay.drain, sample count) for each stack that was draining."""
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, weight = line.rpartition(" ")
        frames = stack.split(";")
        names = [f.split(" (", 1)[0] for f in frames]
        if not weight.isdigit() or DRAIN_FRAME not in names:
            continue
        below = frames[names.index(DRAIN_FRAME) + 1 :]
        stacks.append(([_frame(f) for f in below] or [(DRAIN_FRAME, "outbox_notify")], int(weight)))
    return stacks


def _shares(counter: Counter[str], samples: int, top: int) -> list[dict[str, Any]]:
    return [
        {"name": name, "percent": round(100 * n / samples, 1)}
        for name, n in counter.most_common(top)
    ]


def summarise_profile(raw: Path, top: int = 15) -> dict[str, Any]:
    """Shares of the draining samples: by leaf function, by function on the stack, by package."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    samples = 0
    for frames, count in _drain_stacks(raw):
        samples += count
        own[frames[-1][0]] += count
        packages[frames[-1][1]] += count
        for name in {name for name, _ in frames}:
            total[name] += count
    if not samples:
        raise BenchError("py-spy recorded no sample of the relay draining")
    return {
        "samples": samples,
        "self": _shares(own, samples, top),
        "total": _shares(total, samples, top),
        "packages": _shares(packages, samples, top),
    }
