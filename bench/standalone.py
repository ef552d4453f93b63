"""Benchmarks that are programs of their own (`python -m bench.NAME ... --json PATH`).

`bench.run` starts each registered one as a subprocess after the shared scenarios, with the
run's Redis as OUTBOX_BENCH_REDIS_URL, and keeps its JSON figures in the report under its key;
`bench.report` renders each as a section of docs/benchmarks.md with the module's own
`markdown(figures) -> str`. Registering one is one line in REGISTRY; its module must accept
`--json PATH` (and its quick arguments, when it has a quick mode) and define `markdown`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from bench.brokers import REDIS
from bench.procs import BenchError
from bench.venv import ROOT

OUTPUT_TAIL = 4000  # characters of a failed benchmark's output quoted in its error


@dataclasses.dataclass(frozen=True)
class Standalone:
    """One benchmark module, `bench.<key>`, and how `make bench` / `make bench-quick` run it."""

    key: str  # the module bench.<key>, and its entry in the report
    title: str  # its section's title in docs/benchmarks.md
    quick: tuple[str, ...] | None = None  # its arguments under --quick; None: full mode only
    full: tuple[str, ...] = ()  # its arguments in full mode
    timeout: float = 1800.0  # seconds

    @property
    def module(self) -> str:
        return f"bench.{self.key}"

    def arguments(self, *, quick: bool) -> tuple[str, ...] | None:
        """Its command-line arguments in this mode; None when it does not run in it."""
        return self.quick if quick else self.full


REGISTRY = (
    Standalone("once", "OnceTask: what deduplication costs a worker", quick=("--quick",)),
    Standalone("held", "Held tasks: lateness, a due burst, the drain beside held rows", quick=("--quick",)),
    Standalone("long_writer", "A writer holding the wake lock: what the relays run meanwhile"),
    Standalone("events", "Domain events: published per second through one relay", quick=("--quick",)),
    Standalone("consume", "Domain events: consumed once per second by one consumer", quick=("--quick",)),
    Standalone("rowsize", "Stored bytes per message: the row and the WAL it writes", quick=("--quick",)),
)  # fmt: skip
KEYS = tuple(entry.key for entry in REGISTRY)


def entry(key: str) -> Standalone:
    return next(e for e in REGISTRY if e.key == key)


def environment(world: Any) -> dict[str, str]:
    """The benchmark's environment: the run's Redis, no Django settings of the caller's."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    redis = [b for b in world.brokers if b.key == REDIS]
    if redis:
        env["OUTBOX_BENCH_REDIS_URL"] = redis[0].url
    return env


def run(bench: Standalone, world: Any) -> dict[str, Any]:
    """Run one benchmark as a subprocess; its figures (its output is kept in the work dir)."""
    arguments = bench.arguments(quick=world.quick)
    if arguments is None:
        raise BenchError(f"{bench.module} has no quick mode")
    out = world.work_dir / f"{bench.key}.json"
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", bench.module, *arguments, "--json", str(out)],
        cwd=ROOT,
        env=environment(world),
        capture_output=True,
        text=True,
        timeout=bench.timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    (world.work_dir / f"{bench.key}.log").write_text(output, encoding="utf-8")
    if done.returncode != 0 or not out.exists():
        raise BenchError(
            f"{bench.module} exited {done.returncode} without figures:\n{output[-OUTPUT_TAIL:]}"
        )
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


def renderer(bench: Standalone) -> Callable[[dict[str, Any], dict[str, str]], str]:
    """The report's render function of one benchmark: its module's markdown(figures)."""

    def render(figures: dict[str, Any], sides: dict[str, str]) -> str:
        module = importlib.import_module(bench.module)
        text: str = module.markdown(figures)
        return text

    return render
