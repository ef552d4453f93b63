"""What OnceTask costs a worker: the same bodies as plain tasks and as OnceTasks, one worker.

Run: .venv/bin/python -m bench.once [--tasks 200] [--rounds 10] [--quick] [--dsn URL]
                                    [--db-reuse-max N] [--json PATH]

One real Celery worker (solo pool, bench/onceproject) consumes blocks of --tasks messages of
one kind from Redis (the machine's, OUTBOX_BENCH_REDIS_URL, default redis://127.0.0.1:6379/11).
Each block is published to a staging list first and moved under the worker's queue with one
RENAME, so publishing never paces the worker; a `mark` task before and after the block stamps
the worker's clock (CLOCK_MONOTONIC), and a few warm-up tasks precede it. Kinds:

    plain_noop / once_noop                  an empty body
    plain_row / plain_row_atomic / once_row one INSERT (autocommit / in atomic() / OnceTask)

Then the execution path alone (bench/onceproject/trace.py): Celery's tracer in one process,
--calls calls of each kind interleaved call by call, without the broker.

Every round runs one block of each kind, the kinds of a group back to back, the OnceTask
block always next to the plain blocks it is compared with (plain_row, once_row,
plain_row_atomic), the group's order reversed every other round so neither side always runs
first. OnceTask's overhead is the median over rounds of (OnceTask block - plain block of the
same round): per execution in ms, and as the share of worker throughput lost. Also per execution:
the worker's CPU and its PostgreSQL backend's CPU (from /proc, when the server is local).

PostgreSQL: a private durable server (fsync and synchronous_commit on), or the server of
--dsn / OUTBOX_TEST_DATABASE_URL, where a database of its own is created and dropped.

Connections. Celery's Django fixup closes the worker's database connections after every task
unless CELERY_DB_REUSE_MAX is set, so by default every task that touches the database (and
every OnceTask) connects anew: ~5 ms of connection setup on every row task, which drowns
OnceTask's own cost in noise. So the run has two phases, each with its own worker, database
and execution-path measurement: "new connection" (Celery's default) and "persistent"
(CELERY_DB_REUSE_MAX = 1,000,000, what a production worker that cares about throughput runs).
--db-reuse-max N runs one phase only, with that setting (0: a new connection per task).

The goal of issue 13 (<= 0.3 ms per execution, <= 10 % of worker throughput, for tasks that
write one row) is judged on the persistent phase, OnceTask against the plain task that
inserts its row in autocommit: there the difference is OnceTask's own (its transaction and
the inbox insert), not connection setup that both kinds pay. The execution path alone, which
pairs calls microseconds apart, is the stable cross-check on a busy machine. A second verdict
judges OnceTask against the plain task that writes its row in atomic(), which makes the same
round trips: there the difference is the key insert alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import psycopg
import redis
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools import pgserver
from devtools.process import stop_process
from outbox_notify import sql as sql_files

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
DURABLE = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c max_connections=50"
# Each OnceTask kind sits next to the plain kinds it is compared with; odd rounds reverse.
GROUPS = (("plain_noop", "once_noop"), ("plain_row", "once_row", "plain_row_atomic"))
KINDS = tuple(kind for group in GROUPS for kind in group)
# (label, plain kind, OnceTask kind): the comparisons printed.
PAIRS = (
    ("noop", "plain_noop", "once_noop"),
    ("one row", "plain_row", "once_row"),
    ("one row, plain in atomic()", "plain_row_atomic", "once_row"),
)
WARMUP = 50  # tasks of the block's kind run before its start mark
PERSISTENT = 1_000_000  # CELERY_DB_REUSE_MAX of the persistent phase: never recycled in a run
# (phase name, CELERY_DB_REUSE_MAX) of a default run; --db-reuse-max N runs one of its own.
PHASES = (("new connection", 0), ("persistent", PERSISTENT))
GOAL_PHASE, GOAL_PAIR = "persistent", "one row"  # what issue 13's goal is judged on
# Also reported: the same goal against the plain task that commits its row in atomic(), which
# makes as many round trips as a OnceTask (the difference left is the key insert alone).
GOAL_PAIR_IN_ATOMIC = "one row, plain in atomic()"
GOAL_PLAIN = {GOAL_PAIR: "in autocommit", GOAL_PAIR_IN_ATOMIC: "in atomic()"}
GOAL_MS, GOAL_PCT = 0.3, 10.0
BLOCK_TIMEOUT = 300.0  # seconds for one block to finish
WORKER_START_TIMEOUT = 60.0  # seconds
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One block of tasks of one kind as the worker ran it."""

    kind: str
    round_no: int
    tasks: int
    seconds: float  # wall time between the two marks
    worker_cpu: float  # seconds, spread evenly over every task of the block (warm-up too)
    backend_cpu: float | None  # seconds, likewise; None when the server is not local

    @property
    def ms_per_task(self) -> float:
        return self.seconds * 1000 / self.tasks

    @property
    def tasks_per_second(self) -> float:
        return self.tasks / self.seconds


# --- PostgreSQL --------------------------------------------------------------------------------


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[str]:
    """The server to run on: --dsn's, or a private durable one for the run."""
    if dsn:
        yield dsn
        return
    with pgserver.running(DURABLE) as private:
        yield private.url()


@contextlib.contextmanager
def database(server: str) -> Iterator[str]:
    """A fresh database holding the outbox schema and the effect table; its conninfo."""
    name = f"outbox_bench_once_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        url = make_conninfo(server, dbname=name)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql_files.read("install.sql"))
            conn.execute("CREATE TABLE once_bench_effect (id bigserial PRIMARY KEY, seq int)")
        yield url
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


def _counts(url: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        effects = conn.execute("SELECT count(*) FROM once_bench_effect").fetchone()
        keys = conn.execute("SELECT count(*) FROM outbox_notify_inbox_v1").fetchone()
    return int(effects[0] if effects else 0), int(keys[0] if keys else 0)


# --- the worker ----------------------------------------------------------------------------------


def _worker_env(url: str, queue: str, marks: Path, reuse: int) -> dict[str, str]:
    params = conninfo_to_dict(url)
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="bench.onceproject.settings")
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        BENCH_ONCE_DB_NAME=str(params.get("dbname", "postgres")),
        BENCH_ONCE_DB_USER=str(params.get("user", "postgres")),
        BENCH_ONCE_DB_PASSWORD=str(params.get("password", "")),
        BENCH_ONCE_DB_HOST=str(params.get("host", "127.0.0.1")),
        BENCH_ONCE_DB_PORT=str(params.get("port", "5432")),
        BENCH_ONCE_REDIS_URL=REDIS_URL,
        BENCH_ONCE_QUEUE=queue,
        BENCH_ONCE_MARKS=str(marks),
        BENCH_ONCE_DB_REUSE_MAX=str(reuse),
    )
    return env


@contextlib.contextmanager
def worker(
    url: str, queue: str, marks: Path, log: Path, reuse: int
) -> Iterator[subprocess.Popen[bytes]]:
    """A real Celery worker, solo pool, consuming `queue`; stopped on exit."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.onceproject.app",
        "worker",
        "--pool",
        "solo",
        "-Q",
        queue,
        "--loglevel",
        "WARNING",
        "--without-heartbeat",
        "--without-mingle",
        "--without-gossip",
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=_worker_env(url, queue, marks, reuse), stdout=out, stderr=out
        )
        try:
            yield proc
        finally:
            stop_process(proc, timeout=20)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a local process so far (Linux /proc), None if unreadable."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def backend_pid(url: str) -> int | None:
    """The pid of the worker's PostgreSQL backend (settings name it bench.once.worker)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'bench.once.worker'"
        ).fetchone()
    return None if row is None else int(row[0])


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# --- blocks --------------------------------------------------------------------------------------


class Runner:
    """Publishes blocks to the worker's queue and times them from the worker's marks."""

    def __init__(self, url: str, queue: str, marks: Path, proc: subprocess.Popen[bytes]) -> None:
        self.url, self.queue, self.staging = url, queue, f"{queue}-staging"
        self.marks, self.proc = marks, proc
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.publisher = celery.Celery("bench_once_publisher", broker=REDIS_URL)
        self.publisher.conf.update(task_ignore_result=True)
        self.seq = 0

    def _send(self, name: str, *args: Any) -> None:
        self.publisher.send_task(name, args, queue=self.staging)

    def _release(self) -> None:
        """Move the staged tasks under the worker's queue in one step (it is empty by now)."""
        self.redis.rename(self.staging, self.queue)

    def _wait_mark(self, label: str) -> int:
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}")
            for line in self.marks.read_text().splitlines() if self.marks.exists() else []:
                name, _, stamp = line.partition(" ")
                if name == label:
                    return int(stamp)
            time.sleep(0.02)
        raise RuntimeError(f"no {label!r} mark within {BLOCK_TIMEOUT}s")

    def _stage(self, kind: str, tasks: int, tag: str) -> None:
        for _ in range(WARMUP):
            self._send(f"once_bench.{kind}", self._next())
        self._send("once_bench.mark", f"start-{tag}")
        for _ in range(tasks):
            self._send(f"once_bench.{kind}", self._next())
        self._send("once_bench.mark", f"end-{tag}")

    def block(self, kind: str, tasks: int, round_no: int) -> Block:
        """Run WARMUP + `tasks` tasks of one kind; time the `tasks` between the two marks."""
        tag = uuid.uuid4().hex[:8]
        self._stage(kind, tasks, tag)
        backend = backend_pid(self.url)
        worker_before, backend_before = cpu_seconds(self.proc.pid), cpu_seconds(backend)
        self._release()
        start, end = self._wait_mark(f"start-{tag}"), self._wait_mark(f"end-{tag}")
        worker_cpu = _delta(cpu_seconds(self.proc.pid), worker_before) or 0.0
        backend_cpu = _delta(cpu_seconds(backend), backend_before)
        self.settle()
        # The CPU readings span the warm-up and the marks too: spread them over all of them.
        share = tasks / (tasks + WARMUP + 2)
        return Block(
            kind=kind,
            round_no=round_no,
            tasks=tasks,
            seconds=(end - start) / 1e9,
            worker_cpu=worker_cpu * share,
            backend_cpu=None if backend_cpu is None else backend_cpu * share,
        )

    def settle(self) -> None:
        """Let the worker finish everything queued; leaves the marks file empty."""
        tag = f"idle-{uuid.uuid4().hex[:8]}"
        self._send("once_bench.mark", tag)
        self._release()
        self._wait_mark(tag)
        self.marks.write_text("")

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def cleanup(self) -> None:
        for key in (self.queue, self.staging):
            self.redis.delete(key)
        for key in self.redis.scan_iter(match=f"_kombu.binding.{self.queue}*"):
            self.redis.delete(key)


# --- the report ---------------------------------------------------------------------------------


def _per_kind(blocks: list[Block]) -> dict[str, dict[str, float | None]]:
    kinds: dict[str, dict[str, float | None]] = {}
    for kind in KINDS:
        mine = [b for b in blocks if b.kind == kind]
        backend = [b.backend_cpu * 1e6 / b.tasks for b in mine if b.backend_cpu is not None]
        kinds[kind] = {
            "ms_per_task": statistics.median(b.ms_per_task for b in mine),
            "tasks_per_second": statistics.median(b.tasks_per_second for b in mine),
            "worker_cpu_us_per_task": statistics.median(b.worker_cpu * 1e6 / b.tasks for b in mine),
            "backend_cpu_us_per_task": statistics.median(backend) if backend else None,
        }
    return kinds


def _paired(blocks: list[Block], plain: str, once: str) -> dict[str, float | None]:
    """Median over rounds of the OnceTask block against the plain block of the same round."""
    by_round = {(b.kind, b.round_no): b for b in blocks}
    rounds = sorted({b.round_no for b in blocks})
    pairs = [(by_round[(plain, r)], by_round[(once, r)]) for r in rounds]
    extra = [o.ms_per_task - p.ms_per_task for p, o in pairs]
    lost = [100 * (1 - o.tasks_per_second / p.tasks_per_second) for p, o in pairs]
    cpu = [(o.worker_cpu - p.worker_cpu) * 1e6 / o.tasks for p, o in pairs]
    backend = [
        (o.backend_cpu - p.backend_cpu) * 1e6 / o.tasks
        for p, o in pairs
        if o.backend_cpu is not None and p.backend_cpu is not None
    ]
    return {
        "ms_per_task": statistics.median(extra),
        "ms_per_task_min": min(extra),
        "ms_per_task_max": max(extra),
        "throughput_lost_pct": statistics.median(lost),
        "worker_cpu_us_per_task": statistics.median(cpu),
        # CPU is what a saturated machine runs out of; it varies less with others' load. None
        # when no round had both readings (a server that is not local, a new connection per
        # task); a plain_noop block that ran before the worker's first connection has none.
        "backend_cpu_us_per_task": statistics.median(backend) if backend else None,
    }


def summarise(blocks: list[Block]) -> dict[str, Any]:
    """Median figures per kind and OnceTask's overhead against the plain kinds."""
    return {
        "kinds": _per_kind(blocks),
        "overhead": {label: _paired(blocks, plain, once) for label, plain, once in PAIRS},
    }


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _signed_us(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f} µs"


def _connections(reuse: int) -> str:
    if not reuse:
        return "a new database connection per task (Celery's default)"
    if reuse >= PERSISTENT:
        return "a persistent database connection"
    return f"the database connection reused for {reuse} tasks"


def print_phase(phase: dict[str, Any], tasks: int, rounds: int) -> None:
    """One phase's figures: per kind, OnceTask's overhead, the execution path alone."""
    print(
        f"\n[{phase['name']}] 1 Celery worker (solo pool), {tasks} tasks per block, {rounds} "
        f"rounds (medians); {_connections(phase['db_reuse_max'])}"
    )
    print(f"{'kind':<18}{'ms/task':>9}{'tasks/s':>9}{'worker CPU µs':>15}{'PG CPU µs':>11}")
    for kind, fig in phase["kinds"].items():
        print(
            f"{kind:<18}{fig['ms_per_task']:>9.3f}{fig['tasks_per_second']:>9.0f}"
            f"{_us(fig['worker_cpu_us_per_task']):>15}{_us(fig['backend_cpu_us_per_task']):>11}"
        )
    for label, fig in phase["overhead"].items():
        print(
            f"OnceTask overhead ({label}): {fig['ms_per_task']:+.3f} ms per execution "
            f"(rounds {fig['ms_per_task_min']:+.3f} .. {fig['ms_per_task_max']:+.3f}), "
            f"{fig['throughput_lost_pct']:.1f} % of worker throughput, "
            f"CPU per execution: worker {fig['worker_cpu_us_per_task']:+.0f} µs, "
            f"PostgreSQL {_signed_us(fig.get('backend_cpu_us_per_task'))}"
        )
    path = phase["execution_path"]
    print(
        f"Execution path alone (Celery's tracer in one process, {path['calls']} calls per "
        "kind interleaved, medians):"
    )
    print("  " + ", ".join(f"{k} {us:.0f} µs" for k, us in path["us_per_call"].items()))
    for label, us in path["overhead_us"].items():
        print(f"  OnceTask overhead ({label}): {us / 1000:+.3f} ms per execution")


def goal(phases: list[dict[str, Any]], pair: str = GOAL_PAIR) -> dict[str, Any] | None:
    """Issue 13's goal against the persistent phase's figures of `pair`; None without it."""
    phase = next((p for p in phases if p["name"] == GOAL_PHASE), None)
    if phase is None:
        return None
    worker_fig = phase["overhead"][pair]
    path_ms = phase["execution_path"]["overhead_us"][pair] / 1000
    return {
        "phase": GOAL_PHASE,
        "pair": pair,
        "ms_per_execution": worker_fig["ms_per_task"],
        "throughput_lost_pct": worker_fig["throughput_lost_pct"],
        "execution_path_ms": path_ms,
        "met": worker_fig["ms_per_task"] <= GOAL_MS
        and worker_fig["throughput_lost_pct"] <= GOAL_PCT,
    }


def _goal_line(fig: dict[str, Any]) -> str:
    verdict = "met" if fig["met"] else "not met"
    return (
        f"Goal (<= {GOAL_MS} ms and <= {GOAL_PCT:.0f} % for one-row tasks, judged on the "
        f"{fig['phase']} phase, OnceTask against the plain task "
        f"{GOAL_PLAIN.get(fig['pair'], fig['pair'])}): {verdict}: "
        f"{fig['ms_per_execution']:+.3f} ms per execution, {fig['throughput_lost_pct']:.1f} % "
        f"of worker throughput (execution path alone {fig['execution_path_ms']:+.3f} ms)"
    )


def _phase_markdown(phase: dict[str, Any], tasks: Any, rounds: Any) -> list[str]:
    lines = [
        f"**{phase.get('name', 'run')}**: {_connections(phase.get('db_reuse_max') or 0)}; "
        f"{tasks} tasks per block, {rounds} rounds, medians.",
        "",
        "| kind | ms/task | tasks/s | worker CPU µs/task | PostgreSQL CPU µs/task |",
        "|---|---|---|---|---|",
    ]
    for kind, fig in phase["kinds"].items():
        lines.append(
            f"| {kind} | {fig['ms_per_task']:.3f} | {fig['tasks_per_second']:.0f} | "
            f"{_us(fig['worker_cpu_us_per_task'])} | {_us(fig['backend_cpu_us_per_task'])} |"
        )
    lines += [
        "",
        "| OnceTask against | ms per execution (rounds' range) | worker throughput lost | "
        "execution path alone | CPU per execution: worker, PostgreSQL |",
        "|---|---|---|---|---|",
    ]
    path = phase["execution_path"]
    for label, fig in phase["overhead"].items():
        lines.append(
            f"| {label} | {fig['ms_per_task']:+.3f} ({fig['ms_per_task_min']:+.3f} .. "
            f"{fig['ms_per_task_max']:+.3f}) | {fig['throughput_lost_pct']:.1f} % | "
            f"{path['overhead_us'][label] / 1000:+.3f} ms | "
            f"{_signed_us(fig.get('worker_cpu_us_per_task'))}, "
            f"{_signed_us(fig.get('backend_cpu_us_per_task'))} |"
        )
    return [*lines, ""]


def markdown(summary: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures (also of a report from before phases)."""
    given = summary.get("settings", {})
    tasks, rounds = given.get("tasks", "?"), given.get("rounds", "?")
    # A report written before the run had phases holds one phase's figures at its top level.
    phases = summary.get("phases") or [
        {**summary, "name": "run", "db_reuse_max": given.get("db_reuse_max") or 0}
    ]
    lines = [
        "One Celery worker (solo pool) on Redis against a durable PostgreSQL "
        "(`python -m bench.once`); the execution path alone is Celery's tracer in one process, "
        "calls of each kind interleaved, no broker.",
        "",
    ]
    for phase in phases:
        lines += _phase_markdown(phase, tasks, rounds)
    for key in ("goal", "goal_in_atomic"):
        if summary.get(key):
            lines += [_goal_line(summary[key]) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def _round(runner: Runner, tasks: int, round_no: int) -> list[Block]:
    """One block of every kind; each group runs forward in even rounds, reversed in odd ones."""
    blocks = []
    for group in GROUPS:
        order = group if round_no % 2 == 0 else group[::-1]
        blocks += [runner.block(k, tasks, round_no) for k in order]
    return blocks


def trace(url: str, calls: int, reuse: int) -> dict[str, Any]:
    """The execution path alone, in a process of its own with the worker's settings."""
    env = _worker_env(url, "unused", Path(os.devnull), reuse)
    reconnect = "0" if reuse else "1"
    done = subprocess.run(
        [sys.executable, "-m", "bench.onceproject.trace", str(calls), reconnect],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the execution-path measurement failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_phase(server_url: str, name: str, reuse: int, args: argparse.Namespace) -> dict[str, Any]:
    """One worker with this connection setting, on a database of its own; its figures."""
    queue = f"bench-once-{uuid.uuid4().hex[:8]}"
    blocks: list[Block] = []
    with (
        database(server_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-once-") as tmp,
    ):
        marks, log = Path(tmp) / "marks", Path(tmp) / "worker.log"
        with worker(url, queue, marks, log, reuse) as proc:
            runner = Runner(url, queue, marks, proc)
            try:
                runner.settle()  # the worker is up and consuming
                for round_no in range(args.rounds):
                    blocks += _round(runner, args.tasks, round_no)
            except RuntimeError as exc:
                raise SystemExit(f"{exc}\n--- worker log ---\n{log.read_text()[-3000:]}") from exc
            finally:
                runner.cleanup()
        effects, keys = _counts(url)
        traced = trace(url, args.calls, reuse)
    once_kinds = sum(1 for k in KINDS if k.startswith("once_"))
    expected_keys = args.rounds * once_kinds * (args.tasks + WARMUP)
    if keys != expected_keys:
        raise SystemExit(f"{name}: the inbox holds {keys} keys, expected {expected_keys}")
    return {
        "name": name,
        "db_reuse_max": reuse,
        **summarise(blocks),
        "verified": {"effects": effects, "inbox_keys": keys},
        "execution_path": traced,
        "blocks": [dataclasses.asdict(b) for b in blocks],
    }


def _named_phase(reuse: int) -> tuple[str, int]:
    if not reuse:
        return "new connection", 0
    return ("persistent" if reuse >= PERSISTENT else f"reused for {reuse} tasks"), reuse


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase the arguments ask for, on one server; the figures and the goal's verdict."""
    phases = PHASES if args.db_reuse_max is None else (_named_phase(args.db_reuse_max),)
    results = []
    with server(args.dsn) as server_url:
        for name, reuse in phases:
            results.append(run_phase(server_url, name, reuse, args))
            print_phase(results[-1], args.tasks, args.rounds)
    return {
        "phases": results,
        "goal": goal(results),
        "goal_in_atomic": goal(results, GOAL_PAIR_IN_ATOMIC),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.once",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tasks", type=int, default=200, help="tasks per timed block")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--calls", type=int, default=2000, help="calls per kind for the execution path alone"
    )
    parser.add_argument(
        "--quick", action="store_true", help="100 tasks per block, 3 rounds, 300 calls"
    )
    parser.add_argument("--dsn", default=os.environ.get("OUTBOX_TEST_DATABASE_URL"))
    parser.add_argument(
        "--db-reuse-max",
        type=int,
        default=None,
        metavar="N",
        help="run one phase only, with Celery's CELERY_DB_REUSE_MAX = N for the worker (0: a "
        f"new database connection for every task); default: both phases, 0 and {PERSISTENT}",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a phase at a time
    if args.quick:
        args.tasks, args.rounds, args.calls = 100, 3, 300
    summary = run(args)
    summary["settings"] = {
        "tasks": args.tasks,
        "rounds": args.rounds,
        "calls": args.calls,
        "db_reuse_max": args.db_reuse_max,
    }
    if summary["goal"] is not None:
        print("\n" + _goal_line(summary["goal"]))
        print(_goal_line(summary["goal_in_atomic"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
