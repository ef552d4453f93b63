"""Brings up what the scenarios run on, and describes the machine for the report.

world(): PostgreSQL (bench.services) and the brokers (bench.brokers: Redis, RabbitMQ), the
databases (migrated by each library's own migrations through the benchmark project), one
template row per library from its real write side, the queues (declared as Celery declares
them), and the process registry, all torn down in reverse order when the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import brokers as broker_services
from bench import services
from bench.brokers import Broker
from bench.procs import BenchError, Proc, Processes
from bench.sides import (
    MAIN,
    OURS,
    PEER,
    Side,
    World,
    crash_slot,
    template_from_output,
    with_template,
)
from bench.venv import ROOT

SETUP_TIMEOUT = 120  # seconds
PACKAGES = (
    "outbox-notify",
    "django-celery-outbox",
    "celery",
    "kombu",
    "Django",
    "psycopg",
    "redis",
    "amqp",
    "orjson",
)


@contextlib.contextmanager
def world(work_dir: Path, *, peer: bool, quick: bool, brokers: list[str]) -> Iterator[World]:
    """Everything the scenarios need, for the length of the block."""
    sides = (OURS, PEER) if peer else (OURS,)
    slots = [MAIN, *(crash_slot(key) for key in brokers)]
    names = [slot.database(side) for slot in slots for side in sides]
    with contextlib.ExitStack() as stack:
        early, ready = _start_brokers(stack, brokers, work_dir)
        pg = stack.enter_context(services.postgres())
        stack.enter_context(services.databases(pg, names))
        procs = Processes(work_dir)
        stack.callback(procs.stop_all)  # runs first: nothing may outlive the databases
        first = early or ready()[0]
        bare = World(
            pg=pg, broker=first, brokers=(first,), procs=procs, sides=sides,
            work_dir=work_dir, quick=quick,
        )  # fmt: skip
        migrate(bare)
        rows = templates(bare)
        for side in sides:
            for slot in slots[1:]:
                services.clone_database(pg, MAIN.database(side), slot.database(side))
        chosen = ready()
        for broker in chosen:
            broker_services.declare(broker, queues(broker, sides))
        yield dataclasses.replace(
            bare,
            broker=chosen[0],
            brokers=chosen,
            sides=tuple(with_template(s, row) for s, row in zip(sides, rows, strict=True)),
        )


def _start_brokers(
    stack: contextlib.ExitStack, brokers: list[str], work_dir: Path
) -> tuple[Broker | None, Callable[[], tuple[Broker, ...]]]:
    """Start the chosen brokers; (Redis at once if chosen, a wait for all of them).

    The RabbitMQ node boots in the background (several seconds) while PostgreSQL is
    prepared; every broker gets the run's queue-name prefix.
    """
    rabbit = (
        stack.enter_context(broker_services.rabbit_broker())
        if broker_services.RABBITMQ in brokers
        else None
    )
    redis = (
        stack.enter_context(broker_services.redis_broker(work_dir))
        if broker_services.REDIS in brokers
        else None
    )
    prefix = _run_prefix(brokers)

    def ready() -> tuple[Broker, ...]:
        found = (redis, rabbit() if rabbit else None)
        return tuple(_prefixed(b, prefix) for b in found if b is not None)

    return (_prefixed(redis, prefix) if redis else None), ready


def _run_prefix(brokers: list[str]) -> str:
    """Queue names unique to the run when any broker is a shared server, else plain.

    One prefix for every broker: our template row carries its queue's name (sides.py).
    """
    private = {
        broker_services.REDIS: broker_services.redis_is_private,
        broker_services.RABBITMQ: broker_services.rabbit_is_private,
    }
    if all(private[key]() for key in brokers):
        return ""
    return f"outbox-bench-{uuid.uuid4().hex[:8]}-"


def _prefixed(broker: Broker, prefix: str) -> Broker:
    return dataclasses.replace(broker, prefix=prefix)


def queues(broker: Broker, sides: tuple[Side, ...]) -> list[str]:
    """Every queue name the scenarios use on one broker."""
    slots = (MAIN, crash_slot(broker.key))
    return sorted({broker.queue(slot.queue(side)) for slot in slots for side in sides})


def finish(bare: World, procs: list[Proc], what: str) -> list[str]:
    """Wait for processes started together; their outputs. BenchError if one failed."""
    outputs = []
    for proc in procs:
        try:
            status = proc.popen.wait(SETUP_TIMEOUT)
        finally:
            bare.procs.stop(proc)
        if status != 0:
            raise BenchError(f"{what} failed in {proc.name} ({status}):\n{proc.tail()}")
        outputs.append(proc.output())
    return outputs


def migrate(bare: World) -> None:
    """Each library's migrations, each into its own database, both at once."""
    argv = [sys.executable, "-m", "django", "migrate", "-v", "0", "--database"]
    procs = [bare.procs.start(f"migrate-{s.key}", [*argv, s.alias], bare.env()) for s in bare.sides]
    finish(bare, procs, "migrate")


def templates(bare: World) -> list[dict[str, Any]]:
    """One row per library written by its own write side (then deleted), both at once."""
    procs = [bare.worker(f"template-{s.key}", ["template", "--side", s.key]) for s in bare.sides]
    return [template_from_output(out) for out in finish(bare, procs, "writing a template row")]


def _meminfo() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine(world: World) -> dict[str, Any]:
    """The facts a reader needs to compare these figures with their own."""
    return {
        "nproc": os.cpu_count(),
        "memory": _meminfo(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        "postgresql": {
            "server": "private, started by the benchmark"
            if world.pg.private
            else "given (OUTBOX_TEST_DATABASE_URL / DATABASE_URL)",
            **world.pg.settings(),
        },
        "brokers": {broker.key: broker.describe() for broker in world.brokers},
        "packages": {name: _version(name) for name in PACKAGES},
        "checkout": {
            "commit": _git("rev-parse", "--short", "HEAD"),
            "relay_modified": bool(_git("status", "--porcelain", "outbox_notify")),
        },
    }
