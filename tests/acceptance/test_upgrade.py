"""Upgrades lose nothing: what the previous release wrote is published after migration 0005.

The previous release (OLD_COMMIT: main before 0005_frontier) is taken from the repository's
history with `git archive` and pip-installed into a virtualenv of its own, once per session
(bench.venv.build, pip's cache, pinned to the releases of the running environment). Its
processes run exactly its code: writers doing `apply_async()` in `atomic()`
(tests/acceptance/upgrade_writer.py) and `manage.py outbox_listen`, against a database its own
`migrate` built (up to 0004_inbox). This checkout's `migrate` then applies 0005 underneath
them, as a rolling deploy does, and its relays and writers join.

Every task goes to a private Redis (a server of the test's own: the test pauses its writes and
breaks one queue's key), where tasks are counted by id: each committed one exactly once (no
crash happens here, and the docs allow duplicates only around one), no rolled-back one ever.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import psycopg
import pytest
import redis
from psycopg import sql as pgsql

from bench import venv
from bench.procs import BenchError
from devtools.process import stop_process
from tests.conftest import IN_CI
from tests.integration.test_schema import _catalogue
from tests.relay_support import ROOT, RelayProcess, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(900)]
# timeout: the first test also builds the old release's venv (a pip install).

OLD_COMMIT = "3564066b97904cd86136a5f7e12e62400ea7ac46"  # main before 0005_frontier
OLD_PATHS = ("pyproject.toml", "README.md", "LICENSE", "outbox_notify", "sql", "tests")
# Where a release's code is, and the newest row layout its relays read (SCHEMA_VERSION).
PROBE = "from outbox_notify import serialization as s; print(s.__file__, s.SCHEMA_VERSION)"
WRITER = (Path(__file__).parent / "upgrade_writer.py").read_text()
QUEUE, FAILING = "upgrade", "upgrade-failing"
MESSAGES = "outbox_notify_message_v1"
RELAY_FLAGS = [
    *("--sweep-interval", "1", "--backoff-time", "0.2", "--max-backoff", "2"),
    # Small batches: a relay frozen inside a claim holds few rows back.
    *("--batch-size", "20"),
    # The failing queue stays broken for dozens of tries: none may reach the dead letters.
    *("--max-retries", "100000"),
    # Redis paused for up to PAUSE_MS must not time a publish out: the LPUSH would still land
    # after the pause and the row be published again (an outage is retried). The stale timeout
    # is the shortest this send timeout allows, and longer than old relays stay frozen.
    *("--send-timeout", "60", "--stale-timeout", "150"),
]
PAUSE_MS = 50_000  # Redis writes paused at most this long (the test unpauses sooner)
HELD_FOR = 3.0  # seconds: the countdown of the writers' held tasks
LONG_HELD_FOR = 30.0  # seconds: held rows that stay untouched across the migration
STEP = 120.0  # seconds: a generous deadline for one step (a migrate, a relay's start)
# The indexes 0005 replaces and the ones it creates (sql/migrations/0005_frontier.sql).
DROPPED_INDEXES = {f"{MESSAGES}_ready_idx", f"{MESSAGES}_retry_after_idx"}
NEW_INDEXES = {
    f"{MESSAGES}_ready_txid_idx",
    f"{MESSAGES}_scheduled_idx",
    f"{MESSAGES}_scheduled_txid_idx",
    f"{MESSAGES}_failed_idx",
}


@dataclasses.dataclass(frozen=True)
class Release:
    """One release's interpreter and the project (its `tests` package) its processes run."""

    name: str
    python: Path
    project: Path
    max_version: int  # SCHEMA_VERSION: its relays leave rows of newer layouts alone


def _unavailable(message: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"{message}; CI requires it")
    pytest.skip(message)


def _old_source(dest: Path) -> None:
    """The files of OLD_COMMIT the package and its test project need, from git history."""
    try:
        venv.archive(OLD_COMMIT, dest, OLD_PATHS)
    except BenchError as exc:
        _unavailable(str(exc))


@pytest.fixture(scope="session")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release in a virtualenv of its own, built once per session."""
    base = tmp_path_factory.mktemp("old-release")
    source = base / "source"
    _old_source(source)
    python = venv.build(
        base / "venv",
        # packaging: kombu 5.7's Redis transport imports it and outbox-notify's `redis` extra
        # does not install it (kombu declares it in its own `redis` extra only).
        ["-c", str(venv.pins(base / "pins.txt")), f"{source}[binary,redis]", "packaging"],
        upgrade_pip=False,
    )
    # Only the `tests` package on the path: `outbox_notify` comes from the installed wheel.
    project = base / "project"
    project.mkdir()
    (source / "tests").rename(project / "tests")
    probe = subprocess.run(
        [str(python), "-c", PROBE],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=STEP,
        check=True,
    )
    module, version = probe.stdout.split()
    assert Path(module).is_relative_to(base / "venv"), module  # its own code, not this checkout's
    return Release("old", python, project, int(version))


@pytest.fixture(scope="session")
def current_release() -> Release:
    """This checkout, in the test suite's own environment."""
    from outbox_notify.serialization import SCHEMA_VERSION

    return Release("new", Path(sys.executable), ROOT, SCHEMA_VERSION)


class Stage:
    """One test's database, private Redis and processes of both releases (all stopped after)."""

    def __init__(self, server_url: str, database: str, redis_url: str, logs: Path) -> None:
        self.server_url = server_url
        self.database = database
        self.redis_url = redis_url
        self.redis = redis.Redis.from_url(redis_url)
        self.logs = logs
        self.stop_file = logs / "writers.stop"
        self.processes: list[RelayProcess] = []
        self.writers: list[subprocess.Popen[bytes]] = []
        self.conn = psycopg.connect(server_url, dbname=database, autocommit=True)
        self.started = time.monotonic()

    def note(self, what: str) -> None:
        """Print a step with the seconds since the start (pytest shows it when a test fails)."""
        print(f"{time.monotonic() - self.started:7.2f} s  {what}", flush=True)

    def env(self, release: Release, **extra: str) -> dict[str, str]:
        """A release's processes' environment: its project, this test's database and Redis."""
        inherited = {
            key: value
            for key, value in os.environ.items()
            if key not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
            and not key.startswith(("DJANGO_", "OUTBOX_"))
        }
        return {
            **inherited,
            "PYTHONPATH": str(release.project),
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "OUTBOX_TEST_DATABASE_URL": self.server_url,
            "OUTBOX_TEST_DB_NAME": self.database,
            "OUTBOX_TEST_REDIS_URL": self.redis_url,
            "OUTBOX_TEST_BROKER_URL": self.redis_url,
            "OUTBOX_TEST_RESULT_BACKEND": self.redis_url,
            "OUTBOX_TEST_QUEUE": QUEUE,
            "UPGRADE_QUEUE": QUEUE,
            "UPGRADE_FAILING_QUEUE": FAILING,
            **extra,
        }

    def command(self, release: Release, name: str, *argv: str) -> RelayProcess:
        """Start `python -m django ARGV` of a release (a relay, a migrate); its log is `name`."""
        process = RelayProcess(
            argv[0],
            list(argv[1:]),
            self.env(release),
            self.logs / f"{name}.log",
            python=release.python,
            cwd=release.project,
        )
        self.processes.append(process)
        return process

    def migrate(self, release: Release, *argv: str) -> None:
        """Run a release's `migrate` to its end; it must succeed."""
        process = self.command(release, f"migrate-{release.name}", "migrate", *argv, "--no-input")
        assert process.wait(STEP) == 0, process.output()
        self.note(f"{release.name} migrate {' '.join(argv)} done")

    def relay(self, release: Release, name: str) -> RelayProcess:
        """Start a release's `outbox_listen` and wait until it is connected."""
        relay = self.command(release, name, "outbox_listen", *RELAY_FLAGS)
        wait_for(
            lambda: "outbox.database_connected" in relay.output() or relay.proc.poll() is not None,
            timeout=STEP,
            what=f"relay {name} to connect",
        )
        assert relay.proc.poll() is None, relay.output()
        self.note(f"{name} connected")
        return relay

    def writer(
        self, release: Release, name: str, *, once: bool = False, held_for: float = HELD_FOR
    ) -> None:
        """Start upgrade_writer.py with a release (`once`: wait until it has committed)."""
        log = str(self.logs / f"{name}.jsonl")
        mode = ["once", log] if once else ["loop", log, str(self.stop_file)]
        with (self.logs / f"{name}.out").open("ab") as out:
            process = subprocess.Popen(
                [str(release.python), "-c", WRITER, *mode],
                cwd=release.project,
                env=self.env(release, UPGRADE_WRITER=name, UPGRADE_HELD_FOR=str(held_for)),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if once:
            assert process.wait(STEP) == 0, (self.logs / f"{name}.out").read_text()
            self.note(f"{name} committed")
        else:
            self.writers.append(process)
            self.note(f"{name} started")

    def stop_writers(self) -> None:
        """Let every looping writer end its transaction and exit; each must exit 0."""
        self.stop_file.touch()
        for process in self.writers:
            assert process.wait(STEP) == 0, process.args

    def logged(self, writer: str = "") -> list[dict[str, Any]]:
        """The tasks writers have logged (those of `writer` only, if given)."""
        return [
            json.loads(line)
            for path in sorted(self.logs.glob(f"{writer or '*'}.jsonl"))
            for line in path.read_text().splitlines()
            if line.endswith("}")
        ]

    def published(self) -> collections.Counter[str]:
        """How many times each task id is in the two queues' lists."""
        seen: collections.Counter[str] = collections.Counter()
        for queue in (QUEUE, FAILING):
            if self.redis.type(queue) == b"list":
                seen.update(
                    json.loads(raw)["headers"]["id"] for raw in self.redis.lrange(queue, 0, -1)
                )
        return seen

    def scalar(self, query: str, params: Any = None) -> Any:
        """The first column of the query's first row (None without a row)."""
        row = self.conn.execute(query, params).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        """Stop whatever still runs (a test that failed midway), close the connections."""
        self.stop_file.touch()
        for process in self.writers:
            stop_process(process)
        for process in self.processes:
            process.signal(signal.SIGCONT)  # old relays frozen when the test failed
            process.stop()
        self.conn.close()
        self.redis.close()


@pytest.fixture
def stage(pg_server_url: str, private_redis: Any, tmp_path: Path) -> Iterator[Stage]:
    """An empty database of the test's own (dropped after it), a private Redis, a log folder."""
    name = f"outbox_upgrade_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, dbname="postgres", autocommit=True) as admin:
        admin.execute(
            pgsql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C'").format(
                pgsql.Identifier(name)
            )
        )
    stage = Stage(pg_server_url, name, private_redis.url(), tmp_path)
    try:
        yield stage
    finally:
        stage.close()
        with psycopg.connect(pg_server_url, dbname="postgres", autocommit=True) as admin:
            admin.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


# -- what the database shows ----------------------------------------------------------------

APPLIED = "SELECT name FROM django_migrations WHERE app = 'outbox_notify' ORDER BY id"
# The transaction that applied 0005 (Django records a migration inside its transaction).
MIGRATION_XID = (
    "SELECT xmin::text FROM django_migrations"
    " WHERE app = 'outbox_notify' AND name = '0005_frontier'"
)
TXID_COLUMN = """
SELECT a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
FROM pg_attribute AS a
LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = 'outbox_notify_message_v1'::regclass AND a.attname = 'txid'
"""
TXIDS = "SELECT task_id, xid(txid)::text FROM outbox_notify_message_v1 WHERE task_id = ANY(%s)"
# Where each row's tuple is: a migration that rewrites rows moves them.
CTIDS = "SELECT id, ctid::text FROM outbox_notify_message_v1 ORDER BY id"
# Every column but txid, by row id: what a migration must leave as it was.
ROWS = "SELECT m.id, to_jsonb(m) - 'txid' FROM outbox_notify_message_v1 AS m ORDER BY m.id"
INDEXES = """
SELECT c.relname::text, i.indisvalid AND i.indisready AND i.indislive
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = 'outbox_notify_message_v1'::regclass
"""
# amcheck, in a schema of its own (the schema catalogue reads `public` only): every entry of
# each index is in order and points at a row, and every row that belongs in it is there.
AMCHECK = """
SELECT upgrade_amcheck.bt_index_check(i.indexrelid, true)
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = 'outbox_notify_message_v1'::regclass
  AND c.relam = (SELECT oid FROM pg_am WHERE amname = 'btree')
"""
# Relays inside a claim: their claim connection idle in a transaction that holds a lock on the
# outbox table (both releases name the connection alike).
# A claim waiting for the paused Redis: idle in its transaction for a moment already. One seen
# just after its LPUSH went through, before its commit, is gone a moment later (a CI run
# once took such a claim for the one migrate would wait behind).
CLAIMS = """
SELECT a.pid, a.xact_start FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.application_name = 'outbox_notify.claim'
  AND a.state = 'idle in transaction'
  AND a.state_change < clock_timestamp() - interval '300 milliseconds'
  AND EXISTS (SELECT FROM pg_locks AS l WHERE l.pid = a.pid AND l.granted
              AND l.relation = 'outbox_notify_message_v1'::regclass)
"""
# Transactions still open, whatever they are doing now (a relay's claim stays 'idle in
# transaction' while it waits for Redis, but may run a statement of its own at any moment).
OPEN_TRANSACTIONS = """
SELECT a.pid, a.xact_start FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.xact_start IS NOT NULL
"""
# Rows another session holds locked (a relay's claim): FOR SHARE SKIP LOCKED passes them.
LOCKED = """
SELECT m.task_id FROM outbox_notify_message_v1 AS m
WHERE m.id NOT IN (SELECT s.id FROM outbox_notify_message_v1 AS s FOR SHARE SKIP LOCKED)
"""
MIGRATION_WAITS = """
SELECT EXISTS (
    SELECT FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE a.datname = current_database() AND NOT l.granted AND l.mode = 'AccessExclusiveLock'
      AND l.relation = 'outbox_notify_message_v1'::regclass)
"""
# Rows a relay rescheduled after the migration: txid stamped by a later transaction.
RETRIED_SINCE = """
SELECT count(*) FROM outbox_notify_message_v1
WHERE retries > 0 AND xid(txid)::text::bigint > %s
"""
PENDING = "SELECT count(*) FROM outbox_notify_message_v1"
DEAD = "SELECT count(*) FROM outbox_notify_dead_letter_v1"


def _applied(stage: Stage) -> list[str]:
    return [name for (name,) in stage.conn.execute(APPLIED)]


def _rows(stage: Stage) -> dict[int, Any]:
    return dict(stage.conn.execute(ROWS).fetchall())


def _txids(stage: Stage, task_ids: list[str]) -> dict[str, str]:
    return dict(stage.conn.execute(TXIDS, [task_ids]).fetchall())


def _locked(stage: Stage) -> set[str]:
    """Task ids of the rows some session's claim holds now."""
    return {task_id for (task_id,) in stage.conn.execute(LOCKED)}


def _checked_indexes(stage: Stage) -> set[str]:
    """The outbox table's indexes, each checked valid, ready and consistent with the rows."""
    stage.conn.execute("CREATE SCHEMA IF NOT EXISTS upgrade_amcheck")
    stage.conn.execute("CREATE EXTENSION IF NOT EXISTS amcheck SCHEMA upgrade_amcheck")
    indexes = dict(stage.conn.execute(INDEXES).fetchall())
    assert all(indexes.values()), indexes
    stage.conn.execute(AMCHECK).fetchall()  # raises on a corrupt index
    return set(indexes)


def _ids(lines: list[dict[str, Any]], *kinds: str, before: float = 0, after: float = 0) -> set[str]:
    """Task ids of log lines of `kinds` whose transaction began in (after, before)."""
    return {
        line["id"]
        for line in lines
        if line["kind"] in kinds
        and line["began"] > after
        and (not before or line["began"] < before)
    }


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _stop(relay: RelayProcess) -> None:
    """SIGTERM: the relay finishes the batch in hand and exits 0."""
    relay.signal(signal.SIGTERM)
    assert relay.wait(STEP) == 0, relay.output()


def _wait_published(stage: Stage, count: int) -> None:
    """Wait until `count` more tasks are in Redis than now."""
    start = len(stage.published())
    wait_for(lambda: len(stage.published()) >= start + count, timeout=STEP, what=f"{count} more")


def _report(stage: Stage, task_ids: set[str]) -> Callable[[], str]:
    """For a failed wait: the tasks still missing, their rows, the relays' last output."""

    def text() -> str:
        missing = sorted(task_ids - stage.published().keys())[:20]
        kinds = {line["id"]: line["kind"] for line in stage.logged()}
        rows = stage.conn.execute(
            "SELECT task_id, retries, retry_after, last_error FROM outbox_notify_message_v1"
            " WHERE task_id = ANY(%s)",
            [missing],
        ).fetchall()
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(stage.logs.glob("relay-*.log"))
        )
        return f"missing {[(m, kinds.get(m)) for m in missing]}\nrows {rows}\n{logs}"

    return text


# -- the rolling deploy, phase by phase -------------------------------------------------------


def _old_traffic(stage: Stage) -> bool:
    """The old release at work: ready and held tasks published, failing ones retried."""
    published = stage.published().keys()
    lines = stage.logged()
    retried = stage.scalar("SELECT count(*) FROM outbox_notify_message_v1 WHERE retries > 0")
    return (
        len(_ids(lines, "ready") & published) >= 20
        and len(_ids(lines, "held") & published) >= 3
        and retried >= 3
    )


def _migrate_during_a_claim(stage: Stage, new: Release) -> set[str]:
    """Run the new `migrate` while an old relay holds a claim; the task ids it held.

    Redis's writes are paused, so the old relay's claim stays open (it waits for its LPUSH)
    while `migrate` queues for the outbox table behind it; the pause ends, the relay publishes
    and commits, and the migration runs.
    """
    stage.redis.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    try:

        def claim_held() -> Any:
            claims = stage.conn.execute(CLAIMS).fetchall()
            held = _locked(stage) if claims else set()
            return claims and held and (claims, held)

        claims, held = wait_for(claim_held, timeout=STEP, what="an old relay inside a claim")
        stage.note(f"Redis paused, an old relay holds {len(held)} rows in its claim")
        migrate = stage.command(new, "migrate-new", "migrate", "--no-input")
        wait_for(
            lambda: stage.scalar(MIGRATION_WAITS) or migrate.proc.poll() is not None,
            timeout=STEP,
            what="migrate to queue for the outbox table",
        )
        assert migrate.proc.poll() is None, migrate.output()
        stage.note("migrate waits for the claim")
        # The very claim transactions seen before migrate started are still open.
        assert set(claims) <= set(stage.conn.execute(OPEN_TRANSACTIONS).fetchall())
    finally:
        stage.redis.execute_command("CLIENT", "UNPAUSE")
    assert migrate.wait(STEP) == 0, migrate.output()
    stage.note("Redis unpaused, migrate done")
    return held


def _check_migrated(stage: Stage, untouched: list[str]) -> None:
    """0005 is applied; rows present then (`untouched` since) carry the migration's txid."""
    assert "0005_frontier" in _applied(stage)  # later migrations may follow it
    assert stage.conn.execute(TXID_COLUMN).fetchone() == (True, "pg_current_xact_id()")
    migration = stage.scalar(MIGRATION_XID)
    assert set(_txids(stage, untouched).values()) == {migration}
    assert len(_txids(stage, untouched)) == len(untouched) > 0
    indexes = _checked_indexes(stage)
    assert indexes >= NEW_INDEXES
    assert not DROPPED_INDEXES & indexes


def _old_relays_after_migration(stage: Stage, migrated_at: float) -> None:
    """Only old relays run: they publish tasks written after the migration and retry failing
    ones (each retry's UPDATE stamps the row with a transaction newer than the migration)."""
    migration = int(stage.scalar(MIGRATION_XID))

    def at_work() -> bool:
        fresh = _ids(stage.logged(), "ready", after=migrated_at)
        retried = stage.scalar(RETRIED_SINCE, [migration])
        return len(fresh & stage.published().keys()) >= 20 and retried >= 3

    wait_for(at_work, timeout=STEP, what="the old relays at work after the migration")
    stage.note("old relays published and retried after the migration")


def _freeze(stage: Stage, relays: list[RelayProcess]) -> tuple[float, set[str]]:
    """SIGSTOP the relays: the time they stopped, and the task ids their open claims hold."""
    for relay in relays:
        relay.signal(signal.SIGSTOP)
    wait_for(lambda: all(_process_state(r.pid) == "T" for r in relays), what="SIGSTOP")
    stopped_at = time.time()
    time.sleep(0.5)  # a claim statement sent before the stop ends, and holds its rows
    held = _locked(stage)
    stage.note(f"old relays frozen, holding {len(held)} rows")
    return stopped_at, held


def _new_relay_alone(stage: Stage, old_relays: list[RelayProcess], migrating_at: float) -> None:
    """With the old relays alive but frozen, the new relay publishes on its own: the failing
    tasks (many written and retried by the old release before the migration) once their queue
    is mended, and ready tasks written meanwhile by both releases' writers; all but the rows the
    frozen relays hold in their claims."""
    stopped_at, frozen = _freeze(stage, old_relays)
    try:
        stage.redis.delete(FAILING)  # mended: the next try of each failing task succeeds

        def published_alone() -> bool:
            lines = stage.logged()
            fresh = _ids(lines, "ready", after=stopped_at)
            # Not the rows a claim holds at this moment: a frozen relay's claim statement may
            # have ended after `frozen` was read (the new relay's own claims end at once).
            wanted = (fresh | _ids(lines, "failing")) - frozen - _locked(stage)
            return len(fresh) >= 20 and wanted <= stage.published().keys()

        wait_for(
            published_alone,
            timeout=STEP,
            what="the new relay alone to publish",
            context=_report(stage, _ids(stage.logged(), "failing") - frozen),
        )
        stage.note("the new relay alone published the failing tasks and new ready ones")
        assert _ids(stage.logged(), "failing", before=migrating_at) - frozen
        assert all(_process_state(relay.pid) == "T" for relay in old_relays)
    finally:
        for relay in old_relays:
            relay.signal(signal.SIGCONT)


def test_a_rolling_upgrade_publishes_every_committed_task_once(
    stage: Stage, old_release: Release, current_release: Release
) -> None:
    """Old writers and relays keep running through `migrate` (which waits for an old relay's
    open claim), new relays and writers join, the old relays stop later: every committed task
    reaches Redis exactly once, no rolled-back one does, nothing is left or dead-lettered."""
    old, new = old_release, current_release
    stage.migrate(old)
    assert _applied(stage)[-1] == "0004_inbox"
    stage.redis.set(FAILING, "not a list")  # LPUSH fails (WRONGTYPE): each try spends a retry
    old_a = stage.relay(old, "relay-old-a")
    stage.writer(old, "writer-old-1")
    stage.writer(old, "writer-old-2")
    wait_for(lambda: _old_traffic(stage), timeout=STEP, what="the old release at work")
    stage.note("old relay published ready and held tasks, retried failing ones")
    stage.writer(old, "writer-old-long", once=True, held_for=LONG_HELD_FOR)
    migrating_at = time.time()
    in_claim = _migrate_during_a_claim(stage, new)
    migrated_at = time.time()
    _check_migrated(stage, sorted(_ids(stage.logged("writer-old-long"), "held")))

    old_c = stage.relay(old, "relay-old-c")  # an old relay (re)started after the migration
    _old_relays_after_migration(stage, migrated_at)
    new_b = stage.relay(new, "relay-new-b")
    stage.writer(new, "writer-new-1")
    _new_relay_alone(stage, [old_a, old_c], migrating_at)
    _wait_published(stage, 30)  # every relay and writer at work together
    _stop(old_a)
    stage.note("relay-old-a stopped")
    _wait_published(stage, 20)
    stage.stop_writers()
    _stop(old_c)
    stage.note("writers and relay-old-c stopped")

    lines = stage.logged()
    committed = _ids(lines, "ready", "held", "failing")
    wait_for(
        lambda: committed <= stage.published().keys() and stage.scalar(PENDING) == 0,
        timeout=STEP,
        what="every committed task published",
        context=_report(stage, committed),
    )
    _stop(new_b)
    stage.note("relay-new-b published the rest and stopped")
    published = stage.published()
    assert {task_id: n for task_id, n in published.items() if n > 1} == {}
    assert published.keys() == committed
    assert stage.scalar(DEAD) == 0
    assert in_claim <= committed
    assert {line["writer"] for line in lines} == {
        "writer-old-1",
        "writer-old-2",
        "writer-old-long",
        "writer-new-1",
    }
    assert _ids(lines, "rolled_back")  # the rollbacks happened (and published nothing)
    failing_list = stage.redis.lrange(FAILING, 0, -1)
    assert {json.loads(raw)["headers"]["id"] for raw in failing_list} == _ids(lines, "failing")


# As an old relay leaves a row whose publish failed: a retry spent, its error, the next try ahead.
FAILED_ONCE = """
UPDATE outbox_notify_message_v1
SET retries = retries + 1, retry_after = now() + interval '1 second',
    last_error = 'WRONGTYPE Operation against a key holding the wrong kind of value'
WHERE task_id = ANY(%s)
"""


def test_0005_keeps_every_row_and_migrating_back_restores_0004_with_rows_present(
    stage: Stage, old_release: Release, current_release: Release
) -> None:
    """0005 changes no column of the rows present but gives each the migration's txid, and
    builds valid indexes; a new relay publishes those rows. `migrate outbox_notify 0004_inbox`
    with rows of both releases' writers present restores 0004's exact schema and every row,
    and the old release's relay publishes them."""
    old, new = old_release, current_release
    stage.migrate(old)
    stage.writer(old, "writer-old", once=True)
    stage.conn.execute(FAILED_ONCE, [sorted(_ids(stage.logged(), "failing"))])
    schema_0004, rows_0004 = _catalogue(stage.server_url, stage.database), _rows(stage)
    ctids_0004 = stage.conn.execute(CTIDS).fetchall()
    assert len(rows_0004) == 9

    stage.migrate(new)
    assert _rows(stage) == rows_0004
    # No row rewritten: the table stays locked for the index builds only, not for an UPDATE of
    # every row (nor does it leave a dead copy of each row behind).
    assert stage.conn.execute(CTIDS).fetchall() == ctids_0004
    migration = stage.scalar(MIGRATION_XID)
    written = _ids(stage.logged(), "ready", "held", "failing")
    assert set(_txids(stage, sorted(written)).values()) == {migration}
    indexes = _checked_indexes(stage)
    assert indexes >= NEW_INDEXES
    assert not DROPPED_INDEXES & indexes
    relay = stage.relay(new, "relay-new")  # no saved frontier: it reads each index from its start
    wait_for(
        lambda: stage.scalar(PENDING) == 0 and written <= stage.published().keys(),
        timeout=STEP,
        what="the new relay to publish the old release's rows",
        context=_report(stage, written),
    )
    _stop(relay)
    assert stage.published() == collections.Counter(written)

    # Writers of both releases on 0005: the column's default stamps their transactions.
    stage.writer(new, "writer-new-after", once=True)
    stage.writer(old, "writer-old-after", once=True)
    later = sorted(_ids(stage.logged("writer-*-after"), "failing"))
    stamped = _txids(stage, later).values()
    assert len(stamped) == len(later) == 6
    assert all(int(x) > int(migration) for x in stamped)
    # An UPDATE (a relay rescheduling a failed publish) stamps the updating transaction.
    with stage.conn.transaction():
        updater = stage.scalar("SELECT xid(pg_current_xact_id())::text")
        stage.conn.execute(FAILED_ONCE, [later])
    assert set(_txids(stage, later).values()) == {updater}

    rows_0005 = _rows(stage)
    assert len(rows_0005) == 18
    stage.migrate(new, "outbox_notify", "0004_inbox")
    assert _applied(stage)[-1] == "0004_inbox"
    assert _catalogue(stage.server_url, stage.database) == schema_0004
    assert _rows(stage) == rows_0005
    indexes = _checked_indexes(stage)
    assert indexes >= DROPPED_INDEXES
    assert not NEW_INDEXES & indexes

    # The rolled-back deployment: the old relay publishes every row of a layout it reads.
    readable = {
        task_id
        for task_id, version in stage.conn.execute(
            "SELECT task_id, schema_version FROM outbox_notify_message_v1"
        )
        if version <= old.max_version
    }
    relay = stage.relay(old, "relay-old")
    wait_for(
        lambda: readable <= stage.published().keys(),
        timeout=STEP,
        what="the old relay to publish every row",
        context=_report(stage, readable),
    )
    _stop(relay)
    assert stage.published() == collections.Counter(written | readable)
    assert stage.scalar(PENDING) == 18 - len(readable)  # newer layouts wait for a newer relay
    assert stage.scalar(DEAD) == 0
