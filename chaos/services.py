"""The private servers a chaos run owns: a PostgreSQL cluster, a redis-server, a RabbitMQ node.

All listen on 127.0.0.1 on free ports, are started by this process, and are stopped in
`finally` blocks; faults restart, stop, freeze or alarm only these, never a shared service.
The RabbitMQ node (chaos.rabbit) is started only when a RabbitMQ scenario runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import redis
from psycopg import sql

from devtools import pgserver
from devtools.process import stop_process

DATABASE = "chaos"
PG_READY_TIMEOUT = 60.0  # seconds
REDIS_START_TIMEOUT = 15.0  # seconds
REDIS_STOP_TIMEOUT = 15.0  # seconds
POLL = 0.05  # seconds


class PrivatePostgres:
    """A devtools.pgserver cluster with the chaos database; restartable mid-run."""

    def __init__(self, server: pgserver.PrivateServer) -> None:
        self.server = server
        # libpq ignores the password under the cluster's trust authentication; it is there so
        # the run can check that no log line ever shows it.
        self.password = "pg-" + secrets.token_hex(8)

    @property
    def url(self) -> str:
        """URL of the chaos database, password included."""
        return (
            f"postgresql://{self.server.user}:{self.password}@{self.server.host}:"
            f"{self.server.port}/{DATABASE}"
        )

    def admin(self) -> psycopg.Connection[tuple[Any, ...]]:
        """A fresh autocommit superuser connection to the chaos database."""
        return psycopg.connect(self.server.url(DATABASE), autocommit=True, connect_timeout=5)

    def wait_ready(self, dbname: str = "postgres") -> None:
        """Return once the server accepts connections (it may still be starting up)."""
        deadline = time.monotonic() + PG_READY_TIMEOUT
        while True:
            try:
                psycopg.connect(self.server.url(dbname), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL)

    def create_database(self) -> None:
        """Create the chaos database (the cluster is fresh)."""
        self.wait_ready()
        with psycopg.connect(self.server.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))

    def restart(self) -> None:
        """Fast shutdown and start: every session is cut."""
        self.server.restart()
        self.wait_ready(DATABASE)

    def destroy(self) -> None:
        """Stop the cluster and delete its files."""
        self.server.destroy()


class PrivateRedis:
    """A redis-server subprocess on a free port, with no persistence except on our stop."""

    def __init__(self, log_path: Path) -> None:
        self.port = pgserver.free_port()
        self.password = "redis-" + secrets.token_hex(8)
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-notify-redis-"))
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """Broker URL, password included."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/{db}"

    def client(self) -> redis.Redis:
        """A client with short timeouts, for the run's own checks."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=5,
            socket_connect_timeout=2,
        )

    def start(self) -> None:
        """Start the server (loading what stop() saved) and wait until it answers PING."""
        argv = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.workdir),
            "--dbfilename", "dump.rdb",
            "--requirepass", self.password,
            # SIGTERM saves what the server holds, so a stop loses nothing it had accepted.
            "--shutdown-on-sigterm", "save",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + REDIS_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with contextlib.suppress(redis.RedisError):
                if self.client().ping():
                    return
            time.sleep(POLL)
        raise RuntimeError(f"redis-server did not answer within {REDIS_START_TIMEOUT}s")

    def stop(self) -> None:
        """SIGTERM, which (--shutdown-on-sigterm save) refuses clients, saves, and exits.

        What the broker had accepted survives the restart, as it would on a durable broker;
        the fault under test is the relay's view (nothing answers for a while), not a broker
        that forgets messages it acknowledged.
        """
        if self.proc is not None:
            stop_process(self.proc, REDIS_STOP_TIMEOUT)

    def destroy(self) -> None:
        """Stop the server (without saving) and delete its directory."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a broker frozen by a fault must hear the TERM
            stop_process(proc, REDIS_STOP_TIMEOUT)
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def private_servers(log_dir: Path, rabbitmq: bool) -> Iterator[tuple[PrivatePostgres, Servers]]:
    """Start the servers; all are stopped and removed when the block ends, however it ends."""
    from chaos import rabbit as rabbit_node

    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="rabbit-start"))
        # The node boots (several seconds) while PostgreSQL starts.
        future = pool.submit(rabbit_node.start, log_dir) if rabbitmq else None
        stack.callback(_destroy_when_started, future)
        pg = PrivatePostgres(pgserver.start())
        stack.callback(pg.destroy)
        broker = PrivateRedis(log_dir / "redis.log")
        stack.callback(broker.destroy)
        pg.create_database()
        broker.start()
        yield pg, Servers(redis=broker, rabbit=future.result() if future else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Servers:
    """The run's brokers (RabbitMQ only when a scenario needs it)."""

    redis: PrivateRedis
    rabbit: Any  # chaos.rabbit.ChaosRabbit | None


def _destroy_when_started(future: Future[Any] | None) -> None:
    if future is None:
        return
    with contextlib.suppress(BaseException):  # a failed start removed its own node
        future.result().destroy()
