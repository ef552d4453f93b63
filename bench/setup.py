"""Brings up what the scenarios run on, and describes the machine for the report.

world(): PostgreSQL and Redis (bench.services), the databases (migrated by each library's
own migrations through the benchmark project), one template row per library from its real
write side, and the process registry, all torn down in reverse order when the block ends.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import services
from bench.procs import BenchError, Proc, Processes
from bench.sides import (
    CRASH,
    MAIN,
    OURS,
    PEER,
    World,
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
    "orjson",
)


@contextlib.contextmanager
def world(work_dir: Path, *, peer: bool, quick: bool) -> Iterator[World]:
    """Everything the scenarios need, for the length of the block."""
    sides = (OURS, PEER) if peer else (OURS,)
    names = [slot.database(side) for slot in (MAIN, CRASH) for side in sides]
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(services.postgres())
        broker = stack.enter_context(services.broker(work_dir))
        stack.enter_context(services.databases(pg, names))
        procs = Processes(work_dir)
        stack.callback(procs.stop_all)  # runs first: nothing may outlive the databases
        bare = World(pg=pg, broker=broker, procs=procs, sides=sides, work_dir=work_dir, quick=quick)
        migrate(bare)
        rows = templates(bare)
        ready = World(
            pg=pg,
            broker=broker,
            procs=procs,
            work_dir=work_dir,
            quick=quick,
            sides=tuple(with_template(s, row) for s, row in zip(sides, rows, strict=True)),
        )
        for side in sides:
            services.clone_database(pg, MAIN.database(side), CRASH.database(side))
        yield ready


def _finish(bare: World, procs: list[Proc], what: str) -> list[str]:
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
    _finish(bare, procs, "migrate")


def templates(bare: World) -> list[dict[str, Any]]:
    """One row per library written by its own write side (then deleted), both at once."""
    procs = [bare.worker(f"template-{s.key}", ["template", "--side", s.key]) for s in bare.sides]
    return [template_from_output(out) for out in _finish(bare, procs, "writing a template row")]


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
        "redis": {
            "version": world.broker.version(),
            "server": "private redis-server, no persistence"
            if world.broker.private
            else world.broker.url,
        },
        "packages": {name: _version(name) for name in PACKAGES},
        "checkout": {
            "commit": _git("rev-parse", "--short", "HEAD"),
            "relay_modified": bool(_git("status", "--porcelain", "outbox_notify")),
        },
    }
