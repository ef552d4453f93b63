"""Finds or starts what the demo needs: a PostgreSQL database and a Celery broker.

- PostgreSQL: DATABASE_URL when set, otherwise a private throwaway server (devtools.pgserver).
- Broker: CELERY_BROKER_URL when set, otherwise a free database of a Redis that answers PING
  on localhost, otherwise kombu's filesystem transport in a temporary folder.

Everything this module starts or claims is undone by `Services.close()`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEMO_DATABASE = "outbox_demo"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
# Database 0 is everybody's default and the test suite uses 15; the demo picks among the rest.
REDIS_CANDIDATE_DBS = range(1, 15)
REDIS_CLAIM_KEY = "outbox-notify-demo:claimed"
REDIS_CLAIM_TTL = 24 * 3600  # seconds: a claim left by a killed demo expires by itself
PING_TIMEOUT = 0.5  # seconds
# kombu's filesystem transport, with writes made atomic (see that module).
FILESYSTEM_TRANSPORT = "example.demokit.fstransport:Transport"
SERVER_START_TIMEOUT = 30.0  # seconds for a fresh private server to accept connections


class ServiceError(RuntimeError):
    """PostgreSQL or the broker cannot be provided; the message says what to do."""


@dataclasses.dataclass(kw_only=True)
class Services:
    """The database and broker of one demo run, and how to undo what was started for them."""

    database_url: str = ""
    database_note: str = ""
    broker_url: str = ""
    broker_note: str = ""
    # CELERY_BROKER_* variables for the settings; empty when the user named the broker.
    broker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    cleanups: list[tuple[str, Callable[[], None]]] = dataclasses.field(default_factory=list)
    server: Any = None  # the private PostgreSQL (devtools.pgserver.PrivateServer), if any
    keep_server: bool = False

    def close(self) -> list[str]:
        """Undo everything (last started, first undone); return notes for the user."""
        notes: list[str] = []
        while self.cleanups:
            what, undo = self.cleanups.pop()
            try:
                undo()
            except Exception as exc:
                notes.append(f"{what} failed: {type(exc).__name__}: {exc}")
        if self.server is not None:
            if self.keep_server:
                notes.append(_kept_server_note(self.server))
            else:
                self.server.destroy()
            self.server = None
        return notes


def resolve(workdir: Path, *, keep: bool, use_redis: bool, redis_url: str) -> Services:
    """Database and broker for this run; on failure, whatever was started is undone."""
    services = Services()
    try:
        _resolve_database(services)
        _resolve_broker(services, workdir, use_redis=use_redis, redis_url=redis_url)
    except BaseException:
        services.close()
        raise
    services.keep_server = keep
    if services.server is not None:
        services.database_note = "private throwaway server, " + (
            "left running (--keep)" if keep else "removed at exit"
        )
        if keep:
            _survive_exit()
    return services


# -- PostgreSQL ------------------------------------------------------------------------------


def _resolve_database(services: Services) -> None:
    url = os.environ.get("DATABASE_URL")
    if url:
        services.database_url = url
        services.database_note = "from DATABASE_URL"
        return
    from devtools import pgserver

    try:
        services.server = pgserver.start()
    except RuntimeError as exc:
        raise ServiceError(
            f"cannot start a private PostgreSQL ({exc}); or set DATABASE_URL"
        ) from exc
    _create_database(services.server.url(), DEMO_DATABASE)
    services.database_url = services.server.url(DEMO_DATABASE)


def _create_database(maintenance_url: str, name: str) -> None:
    """CREATE DATABASE, retrying while a just-started server is still starting up."""
    import psycopg
    from psycopg import sql

    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        try:
            with psycopg.connect(maintenance_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the private PostgreSQL did not accept connections: {exc}"
                ) from exc
            time.sleep(0.1)


def _survive_exit() -> None:
    # mirakuru (under pytest-postgresql) SIGKILLs the servers it started when Python exits;
    # --keep means the server outlives us.
    with contextlib.suppress(ImportError):
        from mirakuru import base

        atexit.unregister(base.cleanup_subprocesses)


def _kept_server_note(server: Any) -> str:
    executor = server.executor
    return (
        f"PostgreSQL at {server.url(DEMO_DATABASE)} is still running; stop and remove it with:\n"
        f"    {executor.executable} stop -D {executor.datadir} -m fast && rm -rf {server.base}"
    )


# -- broker ----------------------------------------------------------------------------------


def _resolve_broker(services: Services, workdir: Path, *, use_redis: bool, redis_url: str) -> None:
    url = os.environ.get("CELERY_BROKER_URL")
    if url:
        services.broker_url = url
        services.broker_note = "from CELERY_BROKER_URL"
        return
    reason = "Redis not used (--no-redis / DEMO_NO_REDIS)"
    if use_redis:
        reason = f"no Redis answered at {redis_url}"
        if redis_answers(redis_url):
            reason = f"no free database at {redis_url}, or the redis package is missing"
            claimed = _claim_redis_db(redis_url)
            if claimed is not None:
                services.broker_url = claimed
                services.broker_env = _broker_env(claimed)
                services.broker_note = "a free database of the local Redis, flushed at exit"
                services.cleanups.append((f"flushing {claimed}", lambda: _flush_redis_db(claimed)))
                return
    _use_filesystem(services, workdir / "broker", reason)


def _broker_env(url: str) -> dict[str, str]:
    """Settings variables for a broker the demo chose: this URL, no transport overrides."""
    return {
        "CELERY_BROKER_URL": url,
        "CELERY_BROKER_TRANSPORT": "",
        "CELERY_BROKER_TRANSPORT_OPTIONS": "{}",
    }


def redis_answers(url: str) -> bool:
    """True when a Redis server at `url` answers PING (a raw socket: no client library)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 6379), timeout=PING_TIMEOUT
        ) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _claim_redis_db(base_url: str) -> str | None:
    """redis://host:port/N for the first empty database we could claim, or None."""
    try:
        import redis
    except ImportError:
        return None  # kombu's Redis transport needs the client library too
    root = base_url.rstrip("/").rsplit("/", 1)[0] if _has_db(base_url) else base_url.rstrip("/")
    for db in REDIS_CANDIDATE_DBS:
        url = f"{root}/{db}"
        try:
            with redis.Redis.from_url(url, socket_timeout=2) as client:
                if client.dbsize() == 0 and client.set(
                    REDIS_CLAIM_KEY, str(os.getpid()), nx=True, ex=REDIS_CLAIM_TTL
                ):
                    return url
        except redis.RedisError:
            return None  # past the server's last database, or it wants a password
    return None


def shown(url: str) -> str:
    """The URL with its password masked, for printing."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _has_db(url: str) -> bool:
    return urlsplit(url).path.strip("/").isdigit()


def _flush_redis_db(url: str) -> None:
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        client.flushdb()


def _use_filesystem(services: Services, folder: Path, reason: str) -> None:
    queue, processed, control = (folder / name for name in ("queue", "processed", "control"))
    for path in (queue, processed, control):
        path.mkdir(parents=True, exist_ok=True)
    options = {
        # One folder both ways: producers write where the worker reads.
        "data_folder_in": str(queue),
        "data_folder_out": str(queue),
        "processed_folder": str(processed),
        "store_processed": False,
        # Exchange bindings live here, so the relay routes to the queue the worker declared.
        "control_folder": str(control),
        "polling_interval": 0.02,  # seconds: the worker polls the folder
    }
    services.broker_url = "filesystem://"
    services.broker_note = f"kombu's filesystem transport in {folder}; {reason}"
    services.broker_env = {
        "CELERY_BROKER_URL": services.broker_url,
        "CELERY_BROKER_TRANSPORT": FILESYSTEM_TRANSPORT,
        "CELERY_BROKER_TRANSPORT_OPTIONS": json.dumps(options),
    }
