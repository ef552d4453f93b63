"""What the wake-up trigger costs writers: pgbench throughput with and without it.

Run from the repository root (`make trigger-bench BENCH_ARGS=...` does the same):

    .venv/bin/python -m bench.trigger                       # 2 rounds of 6 s runs, ~3.5 min
    .venv/bin/python -m bench.trigger --quick               # 1 round of 3 s runs
    .venv/bin/python -m bench.trigger --json bench/results/trigger.json
    .venv/bin/python -m bench.trigger --dsn postgresql://user@host/dbname
    .venv/bin/python -m bench.trigger --relay-cmd "python manage.py outbox_listen"
    .venv/bin/python -m bench.trigger --relay-linger 5    # (d) sleeps only after an empty drain
    .venv/bin/python -m bench.trigger --writers 32 --rounds 8   # one writer count, more rounds

1, 8 and 32 pgbench clients each commit one outbox row per transaction, in turn under:

    a  no trigger (the table only)
    b  our trigger, no relay asleep: the try-lock succeeds, nobody notifies
    c  our trigger, a relay asleep for the whole run: every writer notifies (the worst case)
    d  our trigger, a relay cycling: lock, claim, sleep until notified, unlock, drain, again
    e  a naive trigger that always notifies, for reference
    f  no trigger, the same relay as (d) running: (d) / (f) is what the trigger costs writers
       while a relay competes with them for the machine

Without --dsn a private PostgreSQL with durable commits (fsync and synchronous_commit on) is
started and always removed at the end; with --dsn the benchmark creates, and finally drops, its
own database on that server. Configurations alternate inside each round so drift hits all
alike; the table gives the median tps per (configuration, writers) and the ratio to (a).

--relay-cmd runs (d) with a real relay instead of the simulated one: the command is started for
each (d) run with the benchmark database's conninfo in $OUTBOX_BENCH_DSN (and in place of "{dsn}"
in the command) and its parts in libpq's $PGHOST, $PGPORT, $PGUSER, $PGDATABASE (, $PGPASSWORD);
it must take the relay's advisory lock within 30 s, and gets SIGTERM at the end of the run.
(f) starts the same command; since no trigger wakes it, the benchmark NOTIFYs it once when
the first rows arrive (as the trigger's first NOTIFY does in (d)); without that it would sleep
through its first sweep interval, publish less, and leave the writers more CPU than in (d).
Beside the real relay a counting LISTEN session reports the share of transactions that notified.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import psycopg
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from devtools import pgserver
from outbox_notify import sql as outbox_sql

LOCK_KEY = (1869968482, 1)  # the relay's advisory lock, as in sql/install.sql
BENCH_DATABASE = "outbox_notify_trigger_bench"
WRITER_COUNTS = (1, 8, 32)
DEFAULT_ROUNDS = 2
DEFAULT_SECONDS = 6  # per run; pgbench -T takes whole seconds
QUICK_SECONDS = 3  # per run
# Durable commits on purpose: the cost of NOTIFY is a lock held through the commit's WAL flush.
SERVER_OPTIONS = (
    "-c max_connections=200 -c shared_buffers=256MB -c fsync=on -c synchronous_commit=on"
)
RELAY_POLL = 0.1  # seconds: how often a waiting simulated relay checks whether the run ended
KICK_POLL = 0.005  # seconds: how often the kick (see relay_command) looks for the first rows
KICK_PAYLOAD = "bench-kick"  # the trigger's notifications have an empty payload
ANY_ROW = "SELECT 1 FROM outbox_notify_message_v1 LIMIT 1"
RELAY_START_TIMEOUT = 30.0  # seconds a --relay-cmd relay has to take the lock
RELAY_STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL for a --relay-cmd relay
LIBPQ_ENV = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE",
             "password": "PGPASSWORD"}  # fmt: skip

# A valid schema-1 message, so a real relay (--relay-cmd) publishes each row rather than
# dead-lettering it: default routing to one Redis list that the benchmark deletes after each run.
RELAY_QUEUE = "outbox-bench-trigger"
RELAY_REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
OPTIONS = json.dumps(
    {
        "headers": {"lang": "py", "task": "shop.tasks.send_receipt", "id": "bench", "retries": 0},
        "properties": {},
        "embed": {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
        "exchange": "",
        "routing_key": RELAY_QUEUE,
        "serializer": "json",
        "delivery_mode": 2,
        "declare": [],
        "relative": {},
    }
)
# OPTIONS is a constant of this file (no quotes inside), spliced into pgbench's script file.
INSERT_SCRIPT = """\
INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, schema_version)
VALUES (gen_random_uuid()::text, 'shop.tasks.send_receipt', '[42]', '{}', '@OPTIONS@', 1);
""".replace("@OPTIONS@", OPTIONS)
NAIVE_TRIGGER = """\
CREATE OR REPLACE FUNCTION outbox_notify_bench_always_notify() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('outbox_notify_v1', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_notify_bench_always_notify
    AFTER INSERT ON outbox_notify_message_v1
    FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_notify_bench_always_notify();
"""
# UTF8 whatever the server's default (initdb's may be SQL_ASCII), as users' databases are.
CREATE_DATABASE = sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C'")
DROP_TRIGGERS = """\
DROP TRIGGER IF EXISTS outbox_notify_wake_v1 ON outbox_notify_message_v1;
DROP TRIGGER IF EXISTS outbox_notify_bench_always_notify ON outbox_notify_message_v1;
"""
REPORTED_SETTINGS = ("server_version", "fsync", "synchronous_commit", "wal_sync_method",
                     "full_page_writes", "shared_buffers", "max_connections")  # fmt: skip
TPS_LINE = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)$", re.MULTILINE)
COUNT_LINE = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)

Trigger = Literal["none", "ours", "naive"]
RelayKind = Literal["none", "asleep", "cycling"]


class BenchError(Exception):
    """The benchmark cannot go on (pgbench failed, a relay died, ...)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One configuration of the table under test."""

    key: str
    label: str
    trigger: Trigger
    relay: RelayKind


CONFIGS = (
    Config(key="a", label="no trigger", trigger="none", relay="none"),
    Config(key="b", label="our trigger, no relay asleep", trigger="ours", relay="none"),
    Config(key="c", label="our trigger, relay asleep all run", trigger="ours", relay="asleep"),
    Config(key="d", label="our trigger, relay cycling", trigger="ours", relay="cycling"),
    Config(key="e", label="naive always-NOTIFY trigger", trigger="naive", relay="none"),
    # The relay's own work (claims, deletes, with --relay-cmd publishing) competes with the
    # writers for the same CPUs; (d) / (f) isolates what the trigger itself costs them.
    Config(key="f", label="no trigger, relay cycling", trigger="none", relay="cycling"),
)


@dataclass
class RelayStats:
    """What a simulated relay saw during one run."""

    notifications: int = 0  # NOTIFYs received (one per notifying writer transaction)
    sleeps: int = 0  # times it held the lock and waited for a notification
    lock_timeouts: int = 0  # times lock_timeout (50 ms) expired while queued for the lock
    drained: int = 0  # rows it deleted (the real relay: rows it published during the run)


@dataclass
class RelayControl:
    """Shared between the benchmark and a relay thread."""

    stats: RelayStats = field(default_factory=RelayStats)
    stop: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    failure: list[BaseException] = field(default_factory=list)
    linger: float = 0.0  # seconds; see --relay-linger
    kick: bool = False  # see relay_command


@dataclass(frozen=True, kw_only=True)
class Bench:
    """Everything a run needs."""

    pgbench: str
    dsn: str
    script: Path
    seconds: int
    our_trigger: str  # CREATE TRIGGER statement as installed by sql/install.sql
    relay_cmd: str | None
    relay_linger: float  # seconds
    writers: tuple[int, ...] = WRITER_COUNTS


@dataclass(frozen=True, kw_only=True)
class Run:
    """One pgbench run."""

    config: str
    writers: int
    round: int
    tps: float
    transactions: int
    relay: dict[str, int] | None
    load: float  # 1-minute load average at the end: other work on the machine shows here


@dataclass(frozen=True, kw_only=True)
class Summary:
    """The median of the runs of one (configuration, writers) pair."""

    config: str
    label: str
    writers: int
    median_tps: float
    ratio_to_a: float
    runs_tps: list[float]
    notified_share: float | None  # notifying transactions / all transactions


# --- connections and schema -------------------------------------------------------------


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


@contextlib.contextmanager
def bench_database(admin_dsn: str) -> Iterator[str]:
    """A fresh database with schema v1 installed, dropped at the end; yields its conninfo."""
    name = sql.Identifier(BENCH_DATABASE)
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name)
    with _connect(admin_dsn) as admin:
        admin.execute(drop)
        admin.execute(CREATE_DATABASE.format(name))
    try:
        dsn = make_conninfo(admin_dsn, dbname=BENCH_DATABASE)
        with _connect(dsn) as conn:
            conn.execute(outbox_sql.read("install.sql"))
        yield dsn
    finally:
        with _connect(admin_dsn) as admin:
            admin.execute(drop)


def installed_trigger(conn: psycopg.Connection[Any]) -> str:
    """The CREATE TRIGGER statement of our wake-up trigger, as sql/install.sql made it."""
    row = conn.execute(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'outbox_notify_wake_v1'"
    ).fetchone()
    if row is None:
        raise BenchError("sql/install.sql did not create the trigger outbox_notify_wake_v1")
    return str(row[0])


def prepare_table(conn: psycopg.Connection[Any], bench: Bench, trigger: Trigger) -> None:
    """Put the configuration's trigger in place and start from an empty table and a checkpoint."""
    conn.execute(DROP_TRIGGERS)
    if trigger == "ours":
        conn.execute(bench.our_trigger)
    elif trigger == "naive":
        conn.execute(NAIVE_TRIGGER)
    conn.execute("TRUNCATE outbox_notify_message_v1")
    # Every run starts right after a checkpoint, so none gets one in its middle by chance.
    with contextlib.suppress(errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


# --- relays -----------------------------------------------------------------------------


def _count(notifies: Iterator[psycopg.Notify]) -> int:
    return sum(1 for _ in notifies)


def _drain(work: psycopg.Connection[Any]) -> int:
    return work.execute("DELETE FROM outbox_notify_message_v1").rowcount


def _lock(work: psycopg.Connection[Any]) -> bool:
    try:
        work.execute("SELECT pg_advisory_lock(%s, %s)", LOCK_KEY)
    except errors.LockNotAvailable:
        return False
    return True


def _wait_for_notification(listen: psycopg.Connection[Any], stop: threading.Event) -> int:
    while not stop.is_set():
        received = _count(listen.notifies(timeout=RELAY_POLL, stop_after=1))
        if received:
            return received
    return 0


def sleep_all_run(dsn: str, ctl: RelayControl) -> None:
    """Relay (c): hold the lock for the whole run, only reading the notifications."""
    with _connect(dsn) as conn:
        conn.execute("LISTEN outbox_notify_v1")
        conn.execute("SELECT pg_advisory_lock(%s, %s)", LOCK_KEY)
        ctl.ready.set()
        while not ctl.stop.is_set():
            ctl.stats.notifications += _count(conn.notifies(timeout=RELAY_POLL))


def cycle_once(
    listen: psycopg.Connection[Any], work: psycopg.Connection[Any], ctl: RelayControl
) -> None:
    """One sleep of relay (d): lock, claim, wait for a NOTIFY, unlock at once, drain."""
    if not _lock(work):
        ctl.stats.lock_timeouts += 1
        ctl.stats.drained += _drain(work)
        return
    try:
        # Notifications already here came from commits the claim below sees: drop them, so only
        # a writer arriving after the claim wakes us.
        ctl.stats.notifications += _count(listen.notifies(timeout=0))
        ctl.stats.drained += _drain(work)
        ctl.stats.sleeps += 1
        ctl.stats.notifications += _wait_for_notification(listen, ctl.stop)
    finally:
        work.execute("SELECT pg_advisory_unlock(%s, %s)", LOCK_KEY)
    ctl.stats.drained += _drain(work)
    _linger(work, ctl)


def _linger(work: psycopg.Connection[Any], ctl: RelayControl) -> None:
    """With --relay-linger: keep draining every `linger` seconds until a drain finds nothing."""
    while ctl.linger and not ctl.stop.is_set():
        time.sleep(ctl.linger)
        drained = _drain(work)
        ctl.stats.drained += drained
        if not drained:
            return


def cycle_all_run(dsn: str, ctl: RelayControl) -> None:
    """Relay (d): a LISTEN connection and a work connection, cycling until the run ends."""
    with _connect(dsn) as listen, _connect(dsn) as work:
        listen.execute("LISTEN outbox_notify_v1")
        work.execute("SET lock_timeout = '50ms'")
        ctl.ready.set()
        while not ctl.stop.is_set():
            cycle_once(listen, work, ctl)


def _guarded(body: Callable[[str, RelayControl], None], dsn: str, ctl: RelayControl) -> None:
    try:
        body(dsn, ctl)
    except BaseException as exc:  # reported by relay_thread in the main thread
        ctl.failure.append(exc)
        ctl.ready.set()


def _raise_failure(ctl: RelayControl) -> None:
    if ctl.failure:
        raise BenchError(f"the relay thread failed: {ctl.failure[0]!r}") from ctl.failure[0]


@contextlib.contextmanager
def relay_thread(
    body: Callable[[str, RelayControl], None], dsn: str, linger: float = 0.0, *, kick: bool = False
) -> Iterator[RelayStats]:
    """Run a simulated relay (or a notification counter) in a thread for a `with` block."""
    ctl = RelayControl(linger=linger, kick=kick)
    thread = threading.Thread(target=_guarded, args=(body, dsn, ctl), daemon=True)
    thread.start()
    ctl.ready.wait()
    try:
        _raise_failure(ctl)
        yield ctl.stats
    finally:
        ctl.stop.set()
        thread.join()
    _raise_failure(ctl)


def _relay_holds_lock(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s AND objid = %s AND objsubid = 2",
        LOCK_KEY,
    ).fetchone()
    return bool(row and row[0])


def _wait_until_asleep(dsn: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + RELAY_START_TIMEOUT
    with _connect(dsn) as conn:
        while not _relay_holds_lock(conn):
            if proc.poll() is not None:
                raise BenchError(f"--relay-cmd exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise BenchError("--relay-cmd never took the relay's advisory lock")
            time.sleep(RELAY_POLL)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(RELAY_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def relay_env(dsn: str) -> dict[str, str]:
    """Our environment plus the benchmark database, as a conninfo and as libpq's PG* variables."""
    parts = {LIBPQ_ENV[k]: str(v) for k, v in conninfo_to_dict(dsn).items() if k in LIBPQ_ENV}
    # tests/settings.py prefers OUTBOX_TEST_DATABASE_URL (and a test database name) to libpq's
    # variables; from a test run they would point the relay at the test server.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_TEST_")}
    return {
        **inherited,
        **parts,
        "OUTBOX_BENCH_DSN": dsn,
        "OUTBOX_TEST_BROKER_URL": RELAY_REDIS_URL,
    }


@contextlib.contextmanager
def relay_command(command: str, dsn: str, *, kick: bool) -> Iterator[RelayStats]:
    """Run the real relay (--relay-cmd) in its own process group for a `with` block.

    A LISTEN connection of our own counts the notifications writers send meanwhile (one
    per notifying transaction), so the real relay's runs report a notified share too.
    `kick` (the runs without a trigger): wake the relay once when the first rows arrive, as
    the trigger's first NOTIFY does in (d); otherwise it would sleep through the first
    sweep interval of the run, publish less, and leave the writers more CPU than in (d).
    """
    argv = shlex.split(command.replace("{dsn}", dsn))
    proc = subprocess.Popen(argv, env=relay_env(dsn), start_new_session=True)
    try:
        _wait_until_asleep(dsn, proc)
        with relay_thread(count_notifications, dsn, kick=kick) as stats:
            yield stats
    finally:
        _terminate(proc)
        _drop_relay_queue()


def count_notifications(dsn: str, ctl: RelayControl) -> None:
    """Beside a real relay: LISTEN and count writers' notifications (holds no lock).

    With ctl.kick, also NOTIFY once (payload KICK_PAYLOAD, not counted) when rows appear.
    """
    with _connect(dsn) as conn, _connect(dsn) as kicker:
        conn.execute("LISTEN outbox_notify_v1")
        ctl.ready.set()
        kick = ctl.kick
        while not ctl.stop.is_set():
            ctl.stats.notifications += _count_writers(conn, KICK_POLL if kick else RELAY_POLL)
            if kick and kicker.execute(ANY_ROW).fetchone():
                kicker.execute("SELECT pg_notify('outbox_notify_v1', %s)", (KICK_PAYLOAD,))
                kick = False
        ctl.stats.notifications += _count_writers(conn, 0)  # what arrived since the last look


def _count_writers(conn: psycopg.Connection[Any], timeout: float) -> int:
    return sum(1 for n in conn.notifies(timeout=timeout) if n.payload != KICK_PAYLOAD)


def _drop_relay_queue() -> None:
    import redis

    with contextlib.suppress(Exception):
        redis.Redis.from_url(RELAY_REDIS_URL).delete(RELAY_QUEUE)


def relay_for(config: Config, bench: Bench) -> contextlib.AbstractContextManager[RelayStats | None]:
    """The relay a configuration runs with, if any."""
    if config.relay == "asleep":
        return relay_thread(sleep_all_run, bench.dsn)
    if config.relay == "cycling" and bench.relay_cmd:
        return relay_command(bench.relay_cmd, bench.dsn, kick=config.trigger == "none")
    if config.relay == "cycling":
        return relay_thread(cycle_all_run, bench.dsn, bench.relay_linger)
    return contextlib.nullcontext()


# --- pgbench ----------------------------------------------------------------------------


def find_pgbench() -> str:
    """pgbench from the folder of the pg_ctl that devtools.pgserver uses, else from PATH."""
    beside = Path(pgserver.find_pg_ctl()).parent / "pgbench"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("pgbench")
    if not found:
        raise BenchError(f"pgbench is neither at {beside} nor on PATH")
    return found


def parse_pgbench(output: str) -> tuple[float, int]:
    """(tps, transactions processed) from pgbench's report."""
    tps, count = TPS_LINE.search(output), COUNT_LINE.search(output)
    if not tps or not count:
        raise BenchError(f"cannot read pgbench's report:\n{output}")
    return float(tps.group(1)), int(count.group(1))


def pgbench(bench: Bench, writers: int) -> tuple[float, int]:
    """Run pgbench once with the insert script; (tps, transactions)."""
    argv = [bench.pgbench, "-n", "-f", str(bench.script), "-c", str(writers)]
    argv += ["-j", str(min(writers, 2)), "-T", str(bench.seconds), bench.dsn]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"pgbench exited with {done.returncode}: {done.stderr.strip()}")
    return parse_pgbench(done.stdout)


# --- the measurement --------------------------------------------------------------------


def run_once(
    bench: Bench, conn: psycopg.Connection[Any], config: Config, writers: int, rnd: int
) -> Run:
    """Prepare the table, start the relay, run pgbench, stop the relay."""
    prepare_table(conn, bench, config.trigger)
    with relay_for(config, bench) as stats:
        tps, transactions = pgbench(bench, writers)
        if stats is not None and config.relay == "cycling" and bench.relay_cmd:
            # The real relay deletes what it publishes: what the writers left is its backlog.
            row = conn.execute("SELECT count(*) FROM outbox_notify_message_v1").fetchone()
            stats.drained = transactions - int(row[0] if row else 0)
    relay = asdict(stats) if stats else None
    return Run(
        config=config.key,
        writers=writers,
        round=rnd,
        tps=tps,
        transactions=transactions,
        relay=relay,
        load=os.getloadavg()[0],
    )


def measure(bench: Bench, rounds: int) -> list[Run]:
    """Every (configuration, writers) pair once per round, configurations alternating."""
    runs: list[Run] = []
    with _connect(bench.dsn) as conn:
        for rnd in range(1, rounds + 1):
            for writers in bench.writers:
                for config in CONFIGS:
                    runs.append(run_once(bench, conn, config, writers, rnd))
                    _progress(runs[-1], rounds)
    return runs


def _progress(run: Run, rounds: int) -> None:
    where = f"round {run.round}/{rounds}  {run.writers:>2} writers  ({run.config})"
    print(f"{where}  {run.tps:>9,.0f} tps  load {run.load:.1f}", file=sys.stderr, flush=True)


def _notified_share(runs: list[Run]) -> float | None:
    shares = [r.relay["notifications"] / r.transactions for r in runs if r.relay and r.transactions]
    return statistics.median(shares) if shares else None


def summarise(runs: list[Run]) -> list[Summary]:
    """Median tps per (configuration, writers) and its ratio to (a) at the same writer count."""
    counts = sorted({r.writers for r in runs})
    groups = {(c.key, w): [r for r in runs if (r.config, r.writers) == (c.key, w)]
              for c in CONFIGS for w in counts}  # fmt: skip
    medians = {pair: statistics.median(r.tps for r in group) for pair, group in groups.items()}
    return [
        Summary(
            config=c.key,
            label=c.label,
            writers=w,
            median_tps=medians[c.key, w],
            ratio_to_a=medians[c.key, w] / medians["a", w],
            runs_tps=[r.tps for r in groups[c.key, w]],
            notified_share=_notified_share(groups[c.key, w]),
        )
        for c in CONFIGS
        for w in counts
    ]


# --- reporting --------------------------------------------------------------------------


def _cell(summary: Summary) -> str:
    share = "" if summary.notified_share is None else f", {summary.notified_share:.0%} notified"
    return f"{summary.median_tps:,.0f} ({summary.ratio_to_a:.2f}{share})"


def table(summaries: list[Summary]) -> str:
    """A Markdown table: median tps (ratio to (a), share of writers that notified)."""
    counts = sorted({s.writers for s in summaries})
    header = "| configuration | " + " | ".join(f"{w} writer{'s' * (w > 1)}" for w in counts)
    lines = [header + " |", "|---" * (len(counts) + 1) + "|"]
    for config in CONFIGS:
        cells = [_cell(s) for s in summaries if s.config == config.key]
        lines.append(f"| ({config.key}) {config.label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("trigger cost with the relay running, (d) / (f): " + _d_over_f(summaries))
    return "\n".join(lines)


def _d_over_f(summaries: list[Summary]) -> str:
    tps = {(s.config, s.writers): s.median_tps for s in summaries}
    counts = sorted({s.writers for s in summaries})
    return ", ".join(
        f"{tps['d', w] / tps['f', w]:.2f} at {w} writer{'s' * (w > 1)}" for w in counts
    )


def _title(settings: dict[str, Any]) -> str:
    relay = f"relay command {settings['relay_cmd']!r}" if settings["relay_cmd"] else ""
    relay = relay or f"simulated relay, linger {settings['relay_linger_ms']:g} ms"
    return (
        f"median tps of {settings['rounds']} x {settings['seconds']} s runs (ratio to (a), share"
        f" of writer transactions that sent a NOTIFY); (d): {relay}"
    )


def _show(conn: psycopg.Connection[Any], setting: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
    return str(row[0]) if row else "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def machine(bench: Bench, private: bool) -> dict[str, Any]:
    """The facts a reader needs to compare these figures with their own."""
    with _connect(bench.dsn) as conn:
        settings = {name: _show(conn, name) for name in REPORTED_SETTINGS}
    version = subprocess.run(
        [bench.pgbench, "--version"], capture_output=True, text=True, check=False
    )
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "server": "private, started by the benchmark" if private else "given with --dsn",
        "postgresql": settings,
        "pgbench": version.stdout.strip(),
    }


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write the report as JSON, creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


# --- command line -----------------------------------------------------------------------


def _writer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("writer counts must be positive integers")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --quick only changes the defaults of --rounds and --seconds."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.trigger", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s runs")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--seconds", type=int, help=f"seconds per run (default {DEFAULT_SECONDS})")
    parser.add_argument("--dsn", help="use this server instead of a private one")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--relay-cmd", help="run (d) with this relay command instead of the simulated relay"
    )
    parser.add_argument(
        "--relay-linger",
        type=float,
        default=0.0,
        metavar="MS",
        help="simulated relay of (d): after a drain that found rows, drain again MS later instead"
        " of going to sleep; sleep only after an empty drain (default 0: sleep after every drain)",
    )
    parser.add_argument(
        "--writers",
        type=_writer_counts,
        default=WRITER_COUNTS,
        metavar="N,N,...",
        help="pgbench client counts (default " + ",".join(map(str, WRITER_COUNTS)) + ")",
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS)
    args.seconds = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    return args


@contextlib.contextmanager
def admin_dsn(given: str | None) -> Iterator[str]:
    """The --dsn server, or a private durable server destroyed when the block ends."""
    if given:
        yield given
        return
    with pgserver.running(SERVER_OPTIONS) as server:
        yield server.url()


def benchmark(args: argparse.Namespace, dsn: str, script: Path) -> dict[str, Any]:
    """Measure on a prepared database and build the report."""
    with _connect(dsn) as conn:
        our_trigger = installed_trigger(conn)
    bench = Bench(
        pgbench=find_pgbench(),
        dsn=dsn,
        script=script,
        seconds=args.seconds,
        our_trigger=our_trigger,
        relay_cmd=args.relay_cmd,
        relay_linger=args.relay_linger / 1000,
        writers=args.writers,
    )
    load_before = os.getloadavg()
    runs = measure(bench, args.rounds)
    return {
        "command": shlex.join(["python", "-m", "bench.trigger", *sys.argv[1:]]),
        "machine": machine(bench, private=args.dsn is None),
        # Other work on the machine during the run shows here (1, 5, 15 minute averages).
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "settings": {
            "rounds": args.rounds,
            "seconds": args.seconds,
            "writers": list(bench.writers),
            "relay_cmd": args.relay_cmd,
            "relay_linger_ms": args.relay_linger,
        },
        "summary": [asdict(s) for s in summarise(runs)],
        "runs": [asdict(r) for r in runs],
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # SystemExit unwinds the `with` blocks: the private server goes too


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the JSON report."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="outbox-trigger-bench-") as tmp:
        script = Path(tmp) / "insert.sql"
        script.write_text(INSERT_SCRIPT, encoding="utf-8")
        with admin_dsn(args.dsn) as admin, bench_database(admin) as dsn:
            report = benchmark(args, dsn, script)
    summaries = [Summary(**s) for s in report["summary"]]
    print(_title(report["settings"]))
    print(table(summaries))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
