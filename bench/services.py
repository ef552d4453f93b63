"""PostgreSQL and Redis for the benchmark: given ones, or private ones it starts and stops.

PostgreSQL: the server named by OUTBOX_TEST_DATABASE_URL or DATABASE_URL when set (the
benchmark creates and drops its own databases there), else a private durable server
(fsync and synchronous_commit on, pg_stat_statements preloaded) via devtools.pgserver.
Redis: a private `redis-server` on a free port when the binary exists, else database 13 of
the one on localhost (OUTBOX_BENCH_REDIS_URL overrides both). The benchmark never flushes a
Redis database: it deletes its own lists.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.procs import BenchError
from devtools.process import stop_process

PRIVATE_OPTIONS = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c max_connections=200"
    " -c shared_buffers=256MB -c shared_preload_libraries=pg_stat_statements"
    " -c pg_stat_statements.track=all"
)
SHARED_REDIS_URL = "redis://127.0.0.1:6379/13"
REDIS_START_TIMEOUT = 10.0  # seconds
REPORTED_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_sync_method",
    "shared_buffers",
    "max_connections",
)
CREATE_DATABASE = "CREATE DATABASE {} TEMPLATE {} ENCODING 'UTF8' LOCALE 'C'"


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection for the benchmark's own bookkeeping."""
    return psycopg.connect(dsn, autocommit=True)


@dataclass(frozen=True, kw_only=True)
class Postgres:
    """The server the benchmark runs on."""

    admin_dsn: str
    params: dict[str, Any]
    base: Path | None  # data folder of a private server; None for a given one

    @property
    def private(self) -> bool:
        return self.base is not None

    def dsn(self, dbname: str) -> str:
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def postmaster_pid(self) -> int | None:
        """The postmaster of a private server (whose CPU we may read); None otherwise."""
        if self.base is None:
            return None
        return int((self.base / "data" / "postmaster.pid").read_text().split()[0])

    def settings(self) -> dict[str, str]:
        with connect(self.admin_dsn) as conn:
            return {name: _show(conn, name) for name in REPORTED_SETTINGS}


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
    return str(row[0]) if row else "?"


def given_database_url() -> str | None:
    return os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get("DATABASE_URL") or None


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """The given server, or a private one destroyed when the block ends."""
    url = given_database_url()
    if url:
        yield Postgres(admin_dsn=url, params=conninfo_to_dict(url), base=None)
        return
    from devtools import pgserver

    server = pgserver.start(PRIVATE_OPTIONS)
    try:
        url = server.url()
        yield Postgres(admin_dsn=url, params=conninfo_to_dict(url), base=server.base)
    finally:
        server.destroy()


def stat_statements_ready(pg: Postgres) -> bool:
    """Create pg_stat_statements if the server preloads it; False when it cannot be read."""
    with contextlib.suppress(psycopg.Error), connect(pg.admin_dsn) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT count(*) FROM pg_stat_statements")
        return True
    return False


@contextlib.contextmanager
def databases(pg: Postgres, names: list[str]) -> Iterator[None]:
    """Fresh, empty databases for the block, dropped at the end."""
    with connect(pg.admin_dsn) as conn:
        for name in names:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(
                sql.SQL(CREATE_DATABASE).format(sql.Identifier(name), sql.Identifier("template0"))
            )
    try:
        yield
    finally:
        with connect(pg.admin_dsn) as conn:
            for name in names:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


def clone_database(pg: Postgres, source: str, target: str) -> None:
    """Copy a migrated database (nobody may be connected to the source)."""
    with connect(pg.admin_dsn) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(target))
        )
        conn.execute(
            sql.SQL(CREATE_DATABASE).format(sql.Identifier(target), sql.Identifier(source))
        )


@dataclass(frozen=True, kw_only=True)
class Redis:
    """The broker the relays publish to."""

    url: str
    private: bool

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def version(self) -> str:
        info: dict[str, Any] = self.client().info("server")
        return str(info.get("redis_version", "?"))


def _free_port() -> int:
    from devtools.pgserver import free_port

    return free_port()


def _wait_for_ping(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + REDIS_START_TIMEOUT
    client = redis.Redis.from_url(url)
    while True:
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError("the private redis-server did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def broker(log_dir: Path) -> Iterator[Redis]:
    """A private redis-server for the block, or the shared one's database 13."""
    given = os.environ.get("OUTBOX_BENCH_REDIS_URL")
    binary = shutil.which("redis-server")
    if given or not binary:
        yield Redis(url=given or SHARED_REDIS_URL, private=False)
        return
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with (log_dir / "redis.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        _wait_for_ping(url, proc)
        yield Redis(url=url, private=True)
    finally:
        stop_process(proc)
