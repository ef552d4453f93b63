"""What one `delay()` costs: ours, django-celery-outbox 0.4.3 and a plain Celery publish.

    python -m bench.run --scenarios delay              # inside the benchmark's world
    python -m bench.enqueue measure --sentry absent    # one process (bench project settings)
    python -m bench.enqueue measure --sentry absent --bulk-only   # only the bulk() figure

For each Sentry case (`absent`: `import sentry_sdk` fails; `installed`: importable, never
initialised; `initialised`: `sentry_sdk.init()` with a DSN and its default integrations,
events dropped) one process times, in rounds that rotate the order:

- plain `celery.Celery` `delay()` to the run's first broker, Redis unless only RabbitMQ runs
  (the yardstick),
- our `delay()` in `transaction.atomic()`, 1 and 100 calls per transaction,
- the peer's `delay()` the same way (when it is installed),
- our `bulk()` block of BULK_TASKS `delay()` calls, commit included (tasks/s).

A call is timed alone (the transaction's BEGIN and COMMIT are the caller's, and paid once
for all its writes); the whole transaction of one call is reported beside it. The best
round counts, as timings on a shared machine only ever get slower. One process per case,
so ratios within a case compare like with like.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

CASES = ("absent", "installed", "initialised")
CALLS = 2_000  # delay() calls per measurement
QUICK_CALLS = 300
ROUNDS = 3
BULK_TASKS = 20_000
QUICK_BULK_TASKS = 4_000
PER_TRANSACTION = (1, 100)
WORKER_TIMEOUT = 600.0  # seconds
PROFILE_CALLS = 2_000


# --- inside the measuring process -------------------------------------------------------


def _sentry(case: str) -> None:
    if case == "absent":
        sys.modules["sentry_sdk"] = None  # type: ignore[assignment]  # import raises ImportError
    elif case == "initialised":
        import sentry_sdk

        sentry_sdk.init(dsn="http://public@127.0.0.1:9/1", transport=lambda envelope: None)


def _timed_calls(task: Any, alias: str | None, calls: int, per_tx: int) -> dict[str, float]:
    """µs per delay() call, and µs per whole transaction of `per_tx` calls."""
    from django.db import transaction

    in_calls = whole = 0.0
    done = 0
    while done < calls:
        started = time.perf_counter()
        if alias is None:
            task.delay(seq=done, payload="x" * 16)
            elapsed = time.perf_counter() - started
            in_calls += elapsed
            whole += elapsed
            done += 1
            continue
        with transaction.atomic(using=alias):
            first = time.perf_counter()
            for _ in range(per_tx):
                task.delay(seq=done, payload="x" * 16)
                done += 1
            in_calls += time.perf_counter() - first
        whole += time.perf_counter() - started
    return {"us_per_call": in_calls / done * 1e6, "us_per_transaction": whole / done * per_tx * 1e6}


def _bulk_rate(task: Any, alias: str, count: int) -> float:
    from django.db import transaction

    from outbox_notify import bulk

    started = time.perf_counter()
    with transaction.atomic(using=alias), bulk(using=alias):
        for seq in range(count):
            task.delay(seq=seq, payload="x" * 16)
    return count / (time.perf_counter() - started)


def _paths() -> dict[str, tuple[Any, str | None]]:
    from bench.project.benchapp import tasks
    from bench.project.celery_apps import plain_app

    plain = plain_app.tasks[tasks.TASK_NAME]
    paths = {"plain": (plain, None), "ours": (tasks.ours_noop, "ours")}
    if tasks.peer_noop is not None:
        paths["peer"] = (tasks.peer_noop, "default")
    return paths


def _empty(alias: str | None) -> None:
    from django.conf import settings
    from django.db import connections

    if alias is None:
        from bench.brokers import depth_reader

        reader = depth_reader(settings.BROKER_URL)
        reader.purge(settings.OURS_QUEUE)
        reader.close()
        return
    table = "outbox_notify_message_v1" if alias == "ours" else "celery_outbox"
    with connections[alias].cursor() as cursor:
        cursor.execute(f"TRUNCATE {table}")


def _round(paths: dict[str, Any], calls: int, offset: int) -> dict[str, Any]:
    names = list(paths)
    names = names[offset % len(names) :] + names[: offset % len(names)]
    found: dict[str, Any] = {}
    for name in names:
        task, alias = paths[name]
        sizes = (1,) if alias is None else PER_TRANSACTION
        for per_tx in sizes:
            found[f"{name}/{per_tx}"] = _timed_calls(task, alias, calls, per_tx)
            _empty(alias)
    return found


def _profile(task: Any, alias: str) -> list[str]:
    """Top of a cProfile of our delay() in committed transactions of 100 (cumulative time).

    The commits are inside the profile: the rows are written when each transaction commits.
    """
    from django.db import transaction

    profiler = cProfile.Profile()
    for start in range(0, PROFILE_CALLS, 100):
        profiler.enable()
        with transaction.atomic(using=alias):
            for seq in range(start, start + 100):
                task.delay(seq=seq, payload="x" * 16)
        profiler.disable()
    _empty(alias)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    stats.print_stats(r"outbox_notify|celery/app|psycopg/cursor|django/db/backends/utils", 18)
    return [line.rstrip() for line in out.getvalue().splitlines() if "(" in line][:18]


def measure(args: argparse.Namespace) -> None:
    """Print one JSON line: best µs per call of each path, bulk tasks/s, a profile."""
    _sentry(args.sentry)
    import django

    django.setup()
    paths = _paths()
    if args.bulk_only:
        paths = {"ours": paths["ours"]}
    for task, alias in paths.values():  # connections, prepared imports, declared queues
        _timed_calls(task, alias, 20, 1)
        _empty(alias)
    best: dict[str, Any] = {}
    if not args.bulk_only:
        rounds = [_round(paths, args.calls, offset) for offset in range(args.rounds)]
        best = {k: min((r[k] for r in rounds), key=lambda m: m["us_per_call"]) for k in rounds[0]}
    bulk_rates = []
    for _ in range(args.rounds):
        bulk_rates.append(_bulk_rate(paths["ours"][0], "ours", args.bulk))
        _empty("ours")
    result = {
        "sentry": args.sentry,
        "calls": args.calls,
        "rounds": args.rounds,
        "best": best,
        "bulk_tasks_per_s": max(bulk_rates),
        "bulk_rounds_tasks_per_s": [round(rate) for rate in bulk_rates],
        "bulk_tasks": args.bulk,
        "profile": _profile(paths["ours"][0], "ours") if args.profile else [],
    }
    print(json.dumps(result))


# --- inside bench.run ------------------------------------------------------------------


def run(world: Any) -> dict[str, Any]:
    """One measuring process per Sentry case; the profile is taken in the `absent` case."""
    from bench import db
    from bench.procs import BenchError

    calls = QUICK_CALLS if world.quick else CALLS
    bulk_tasks = QUICK_BULK_TASKS if world.quick else BULK_TASKS
    cases = []
    for side in world.sides:
        db.reset(world, side)
    for case in CASES:
        argv = [
            sys.executable,
            "-m",
            "bench.enqueue",
            "measure",
            f"--sentry={case}",
            f"--calls={calls}",
            f"--rounds={ROUNDS}",
            f"--bulk={bulk_tasks}",
            *(["--profile"] if case == "absent" else []),
        ]
        # django-celery-outbox imports sentry_sdk unconditionally: it cannot run without it.
        env = world.env(**({"BENCH_PEER": "0"} if case == "absent" else {}))
        proc = world.procs.start(f"delay-{case}", argv, env)
        try:
            status = proc.popen.wait(WORKER_TIMEOUT)
        finally:
            world.procs.stop(proc)
        lines = [line for line in proc.output().splitlines() if line.startswith("{")]
        if status != 0 or not lines:
            raise BenchError(f"bench.enqueue ({case}) failed ({status}):\n{proc.tail()}")
        cases.append(json.loads(lines[-1]))
    return {"broker": world.broker.key, "calls": calls, "cases": cases}


def table(result: dict[str, Any], sides: dict[str, str]) -> str:
    """Markdown: µs per delay() and the ratio to a plain publish, per Sentry case."""
    lines = [
        "| sentry-sdk | path | µs per `delay()` | ÷ plain publish | µs per whole transaction |",
        "|---|---|---:|---:|---:|",
    ]
    for case in result["cases"]:
        best = case["best"]
        plain = best["plain/1"]["us_per_call"]
        for key, label in _labels(sides, result.get("broker", "redis")):
            if key not in best:
                continue
            cell = best[key]
            lines.append(
                f"| {case['sentry']} | {label} | {cell['us_per_call']:.0f} | "
                f"{cell['us_per_call'] / plain:.2f} | {cell['us_per_transaction']:.0f} |"
            )
        lines.append(
            f"| {case['sentry']} | outbox-notify `bulk()`, {case['bulk_tasks']:,} tasks, "
            f"commit included | {1e6 / case['bulk_tasks_per_s']:.1f} "
            f"({case['bulk_tasks_per_s']:,.0f} tasks/s) | "
            f"{1e6 / case['bulk_tasks_per_s'] / plain:.2f} | |"
        )
    profile = next((c["profile"] for c in result["cases"] if c.get("profile")), [])
    if profile:
        lines += [
            "",
            "cProfile of our `delay()` (committed transactions of 100, sentry-sdk absent):",
            "",
        ]
        lines += ["```", *profile, "```"]
    return "\n".join(lines) + "\n"


def _labels(sides: dict[str, str], broker: str) -> list[tuple[str, str]]:
    # The plain publish is the only path here that reaches a broker: the run's first one.
    name = {"redis": "Redis", "rabbitmq": "RabbitMQ"}.get(broker, broker)
    labels = [("plain/1", f"plain `celery.Celery` `delay()` to {name}")]
    for key in ("ours", "peer"):
        if key in sides:
            labels += [
                (f"{key}/{n}", f"{sides[key]}, {n} per transaction") for n in PER_TRANSACTION
            ]
    return labels


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.enqueue")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("measure")
    sub.add_argument("--sentry", choices=CASES, required=True)
    sub.add_argument("--calls", type=int, default=CALLS)
    sub.add_argument("--rounds", type=int, default=ROUNDS)
    sub.add_argument("--bulk", type=int, default=BULK_TASKS)
    sub.add_argument("--profile", action="store_true")
    sub.add_argument(
        "--bulk-only", action="store_true", help="only the bulk() rounds (no per-call paths)"
    )
    return parser.parse_args(argv)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"measure": measure}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    COMMANDS[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
