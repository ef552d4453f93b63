"""`python -m chaos.run [--quick] [--json PATH]`: fault injection under load, every message counted.

Starts a private PostgreSQL, a private redis-server and (when a RabbitMQ scenario is chosen)
a private RabbitMQ node, migrates the chaos project, starts a Celery worker per broker, then
for each scenario: two relays on the scenario's broker, 16 writer threads, the fault, a
drain, the accounting. Exits 1 when any scenario broke a rule (see docs/reliability.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """How long each phase of a scenario lasts, and how hard the writers write."""

    warmup: float  # seconds of load before the fault
    cooldown: float  # seconds of load after the fault
    drain_timeout: float  # seconds to wait for everything to be executed
    rate: float  # transactions per second per writer thread


FULL = Timing(warmup=3.0, cooldown=5.0, drain_timeout=120.0, rate=5.0)
QUICK = Timing(warmup=1.0, cooldown=1.5, drain_timeout=60.0, rate=5.0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short subset (about 2 min)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--only", nargs="+", metavar="SCENARIO", help="run only these")
    parser.add_argument("--log-dir", type=Path, help="where relay/worker logs are kept")
    parser.add_argument("--seed", type=int, default=1, help="random seed of faults and writers")
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; print the table; return 1 if any rule was broken."""
    args = parse(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="outbox-notify-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    from chaos import scenarios

    chosen = scenarios.plan(quick=args.quick, only=args.only)
    print(f"chaos: {len(chosen)} scenario(s); logs in {log_dir}", flush=True)
    began = time.monotonic()
    results = _run_all(chosen, args, log_dir)
    return _finish(results, args, log_dir, time.monotonic() - began)


def _run_all(chosen: list[Any], args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    from chaos.harness import Harness
    from chaos.services import private_servers
    from chaos.sites import RABBITMQ

    timing = QUICK if args.quick else FULL
    results: list[dict[str, Any]] = []
    brokers = {scenario.broker for scenario in chosen}
    with private_servers(log_dir, rabbitmq=RABBITMQ in brokers) as (pg, servers):
        harness = Harness(pg, servers, log_dir, timing=timing, quick=args.quick, brokers=brokers)
        try:
            harness.prepare()
            for number, scenario in enumerate(chosen):
                rng = random.Random(args.seed * 7919 + number)
                result = harness.run(scenario, rng)
                results.append(result)
                print(_one_line(result), flush=True)
        finally:
            harness.close()
    return results


def _one_line(result: dict[str, Any]) -> str:
    verdict = "ok" if not result["violations"] else "FAIL: " + "; ".join(result["violations"])
    return (
        f"chaos: {result['scenario']}: committed={result['committed']} "
        f"executed={result['executed']} effects={result['effects_applied']} "
        f"lost={result['lost']} dups={result['duplicates']} "
        f"({result['seconds']} s) {verdict}"
    )


def _finish(
    results: list[dict[str, Any]], args: argparse.Namespace, log_dir: Path, seconds: float
) -> int:
    from chaos import report

    command = "make chaos-quick" if args.quick else "make chaos"
    print()
    print(f"Results ({command}, {seconds:.0f} s, seed {args.seed}):")
    print(report.table(results))
    print()
    print(report.details(results))
    print(f"\nlogs: {log_dir}")
    payload = {
        "mode": "quick" if args.quick else "full",
        "command": f"python -m chaos.run{' --quick' if args.quick else ''} --seed {args.seed}",
        "seconds": round(seconds, 1),
        "seed": args.seed,
        "python": sys.version.split()[0],
        "log_dir": str(log_dir),
        "scenarios": results,
    }
    if args.json:
        report.write_json(args.json, payload)
    return 1 if any(result["violations"] for result in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
