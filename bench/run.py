"""Benchmarks of outbox-notify side by side with django-celery-outbox 0.4.3, on Redis and RabbitMQ.

    make bench            # full run, 15-25 min: bench/results/latest.json and docs/benchmarks.md
    make bench-quick      # short run, 3-5 min: bench/results/quick.json (docs untouched)
    python -m bench.run --quick --no-peer --out /tmp/bench.json    # ours only (the smoke test)
    python -m bench.run --scenarios latency,drain --brokers rabbitmq --write-docs
    python -m bench.run --render bench/results/latest.json          # docs again from a report
    python -m bench.run --no-peer --brokers redis --scenarios versus --versus v0.3.0 --no-docs

Everything runs in .venv-bench/ (created on first use: this checkout, django-celery-outbox
0.4.3, matplotlib, py-spy) except with --no-peer, which needs neither the peer nor that venv.
PostgreSQL is the server named by OUTBOX_TEST_DATABASE_URL / DATABASE_URL, else a private
durable one; Redis is a private redis-server (OUTBOX_BENCH_REDIS_URL to use another);
RabbitMQ is a private node (devtools.rabbitserver; OUTBOX_BENCH_AMQP_URL to use another, with
queue names unique to the run, deleted at the end). Each library gets its own databases and
queues; the scenarios alternate the libraries, and those that touch a broker run once per
broker (latency, drain, crash, ceiling, profile; writers for its relay-running rows).
The versus scenario runs this checkout's relay against a previous commit's (--versus REV,
default bench.versus.DEFAULT_REV; its venv built once under .venv-versus/), alternating, on Redis.
snapshot (an old snapshot held 10 minutes under 2,000 msg/s) and soak (30 minutes at a steady
rate) run on Redis only, long in full mode (about 45 and 60 minutes), seconds with --quick.
Then the benchmarks that are programs of their own (bench/standalone.py: once, held,
long_writer; in --quick only those with a quick mode), each as a subprocess on the run's Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import brokers, standalone, venv

RESULTS = venv.ROOT / "bench" / "results"
DOCS = venv.ROOT / "docs" / "benchmarks.md"
IMAGES = venv.ROOT / "docs" / "img"
# The scenarios of the shared world, then the benchmarks that are programs of their own
# (bench.standalone.REGISTRY: once, held, long_writer, ...), run after them in that order.
WORLD_SCENARIOS = (
    "crash", "latency", "drain", "writers", "idle", "enqueue", "delay", "ceiling", "versus",
    "snapshot", "soak",
)  # fmt: skip
SCENARIOS = WORLD_SCENARIOS + standalone.KEYS
# Scenarios whose figures depend on the broker: run once per broker, reported as NAME.BROKER.
PER_BROKER = ("crash", "latency", "drain", "ceiling", "profile")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="short runs (<= 2 min); docs untouched"
    )
    parser.add_argument(
        "--no-peer",
        dest="peer",
        action="store_false",
        help="outbox-notify only: no django-celery-outbox, no .venv-bench",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--brokers",
        default=",".join(brokers.KEYS),
        help=f"comma-separated subset of {','.join(brokers.KEYS)}",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON results (default bench/results/latest.json, quick.json with --quick)",
    )
    parser.add_argument(
        "--write-docs", action="store_true", help="write docs/benchmarks.md even with --quick"
    )
    parser.add_argument("--no-docs", action="store_true", help="never write docs/benchmarks.md")
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="py-spy our relay during an extra drain (default: on in full mode with the peer)",
    )
    parser.add_argument(
        "--versus",
        metavar="REV",
        default=None,
        help="the commit the versus scenario runs against, alternating (default: bench.versus.DEFAULT_REV)",
    )
    parser.add_argument(
        "--versus-rounds",
        metavar="N",
        type=int,
        default=None,
        help="rounds of the versus scenario (default 4, quick 2): more rounds, steadier medians on a noisy machine",
    )
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="only write the docs again from a saved report"
    )
    parser.add_argument(
        "--work-dir", type=Path, help="keep the logs here instead of a temporary folder"
    )
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    if args.quick:  # a benchmark without a quick mode runs in `make bench` only
        args.scenarios = [
            name
            for name in args.scenarios
            if name not in standalone.KEYS or standalone.entry(name).quick is not None
        ]
    args.brokers = [b for b in brokers.KEYS if b in {x.strip() for x in args.brokers.split(",")}]
    if not args.brokers:
        parser.error(f"--brokers names none of {', '.join(brokers.KEYS)}")
    if args.versus_rounds is not None and args.versus_rounds < 1:
        parser.error("--versus-rounds must be at least 1")
    args.out = args.out or RESULTS / ("quick.json" if args.quick else "latest.json")
    args.write_docs = not args.no_docs and (args.write_docs or not args.quick)
    if args.profile is None:
        args.profile = args.peer and not args.quick
    return args


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if (args.peer or args.render) and not venv.inside():
        venv.reexec(raw)  # does not return
    if args.render:
        return render(args.render)
    # SIGTERM unwinds like Ctrl-C, so every finally block stops what it started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    report = benchmark(args, shown_command(raw))
    report["runtime_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, report)
    from bench import report as reporting

    print(reporting.text(report))
    if args.write_docs:
        reporting.write_docs(report, DOCS, IMAGES)
        print(f"bench: wrote {DOCS.relative_to(venv.ROOT)}", file=sys.stderr)
    print(f"bench: wrote {args.out} in {report['runtime_s']:.0f} s", file=sys.stderr)
    return 1 if failed(report) else 0


def shown_command(raw: list[str]) -> str:
    """The command line for the report, without the flags that only say where files go."""
    shown, skip = [], False
    for arg in raw:
        if skip:
            skip = False
        elif arg in ("--out", "--work-dir"):
            skip = True
        elif not arg.startswith(("--out=", "--work-dir=")):
            shown.append(arg)
    return shlex.join(["python", "-m", "bench.run", *shown])


def render(path: Path) -> int:
    """Write docs/benchmarks.md and its plots again from a saved report."""
    from bench import report as reporting

    report = reporting.upgrade(json.loads(path.read_text(encoding="utf-8")))
    reporting.write_docs(report, DOCS, IMAGES)
    print(f"bench: wrote {DOCS.relative_to(venv.ROOT)} from {path}", file=sys.stderr)
    return 0


def failed(report: dict[str, Any]) -> list[str]:
    """Names of the scenarios that raised."""
    return [n for n, s in report["scenarios"].items() if s["status"] != "ok"]


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


@contextlib.contextmanager
def work_dir(given: Path | None) -> Any:
    if given:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as tmp:
        yield Path(tmp)


def benchmark(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Start the services, prepare the databases, run the scenarios; the report."""
    from bench import setup

    with (
        work_dir(args.work_dir) as folder,
        setup.world(folder, peer=args.peer, quick=args.quick, brokers=args.brokers) as world,
    ):
        scenarios = run_scenarios(
            world, args.scenarios, args.profile, args.versus, args.versus_rounds
        )
        return {
            "command": command,
            "mode": "quick" if args.quick else "full",
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": setup.machine(world),
            "sides": {s.key: s.label for s in world.sides},
            "brokers": {b.key: b.label for b in world.brokers},
            "scenarios": scenarios,
        }


def guarded(name: str, body: Callable[[], Any]) -> dict[str, Any]:
    """Run one scenario; an exception becomes its error entry (the others still run)."""
    print(f"bench: {name} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        result = body()
    except Exception as exc:
        print(f"bench: {name} FAILED: {exc}", file=sys.stderr, flush=True)
        return {
            "status": "error",
            "error": "".join(traceback.format_exception(exc))[-6000:],
            "seconds": round(time.monotonic() - started, 1),
        }
    seconds = round(time.monotonic() - started, 1)
    print(f"bench: {name} done in {seconds:.0f} s", file=sys.stderr, flush=True)
    return {"status": "ok", "seconds": seconds, "result": result}


def run_scenarios(
    world: Any,
    names: list[str],
    profile: bool,
    versus_rev: str | None = None,
    versus_rounds: int | None = None,
) -> dict[str, Any]:
    """Each chosen scenario in a fixed order; the peer's crash waits overlap the others."""
    from bench import drain, idle, latency, micro, snapshot, soak, versus

    runners: dict[str, Callable[[Any], Any]] = {
        "snapshot": lambda world: snapshot.run(_on_redis(world)),
        "soak": lambda world: soak.run(_on_redis(world)),
        "latency": latency.run,
        "drain": drain.run,
        "writers": _writers,
        "idle": idle.run,
        "enqueue": micro.enqueue,
        "delay": _delay,
        "ceiling": micro.ceiling,
        "versus": functools.partial(
            versus.run, rev=versus_rev or versus.DEFAULT_REV, rounds=versus_rounds
        ),
    }
    results: dict[str, Any] = {}
    waiting: dict[str, list[Any]] = {}
    if "crash" in names:
        for broker in world.brokers:
            here = world.on(broker)
            waiting[broker.key] = []
            results[f"crash.{broker.key}"] = guarded(
                f"crash on {broker.label} (start)",
                functools.partial(_crash_start, here, waiting[broker.key]),
            )
    for name in WORLD_SCENARIOS:
        if name in names and name in runners:
            _run_one(world, name, runners[name], results)
    if profile:
        _run_one(world, "profile", _profile, results)
    for bench in standalone.REGISTRY:
        if bench.key in names:
            results[bench.key] = guarded(bench.key, functools.partial(standalone.run, bench, world))
    for broker in world.brokers:
        _crash_join(world.on(broker), waiting.get(broker.key, []), results)
    return results


def _on_redis(world: Any) -> Any:
    """The world publishing to Redis when the run has it (the issue measured on Redis)."""
    chosen = [b for b in world.brokers if b.key == brokers.REDIS]
    return world.on(chosen[0]) if chosen else world


def _delay(world: Any) -> Any:
    from bench import enqueue

    return enqueue.run(world)


def _run_one(world: Any, name: str, run: Callable[[Any], Any], results: dict[str, Any]) -> None:
    """One scenario: once per broker for those that depend on it, else once."""
    if name not in PER_BROKER:
        results[name] = guarded(name, lambda: run(world))
        return
    for broker in world.brokers:
        results[f"{name}.{broker.key}"] = guarded(
            f"{name} on {broker.label}", functools.partial(run, world.on(broker))
        )


def _profile(world: Any) -> Any:
    from bench import drain

    ours = next(s for s in world.sides if s.key == "ours")
    return drain.profile(world, ours, world.work_dir)


def _writers(world: Any) -> Any:
    from bench import writers

    return writers.run(world)


def _crash_start(world: Any, waiting: list[Any]) -> dict[str, Any]:
    """Ours is waited for at once; the peer's wait (its stale timeout) runs in the background."""
    from bench import crash

    rows = []
    for side in world.sides:
        pending = crash.start(world, side)
        if side.key == "ours":
            rows.append(pending.join(world))
        else:
            waiting.append(pending)
    return {
        "broker": world.broker.key,
        "rows": rows,
        "cap_s": crash.QUICK_CAP if world.quick else crash.CAP,
    }


def _crash_join(world: Any, waiting: list[Any], results: dict[str, Any]) -> None:
    """Wait for the peer's crash recovery on one broker (started before the other scenarios)."""
    key = f"crash.{world.broker.key}"
    if not waiting or results[key]["status"] != "ok":
        return
    joined = guarded(
        f"crash on {world.broker.label} (waiting for the peer)",
        lambda: [p.join(world) for p in waiting],
    )
    if joined["status"] == "ok":
        results[key]["result"]["rows"].extend(joined["result"])
    else:
        results[key] = joined


if __name__ == "__main__":
    sys.exit(main())
