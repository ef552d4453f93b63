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
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
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
    """A redis-server subprocess on a free port, with no persistence except on our stop.

    It also listens on a Unix socket, from boot: the run's MONITOR (chaos.brokerwatch) uses
    it. start() opens the TCP port only after `before_open` ran, so after a restart the
    MONITOR is back before any relay or worker can send a command (no gap in what it sees).
    """

    def __init__(self, log_path: Path) -> None:
        self.port = pgserver.free_port()
        self.password = "redis-" + secrets.token_hex(8)
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-notify-redis-"))
        self.socket_path = str(self.workdir / "redis.sock")
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        # Called once the server answers on its socket, before its TCP port opens; what it
        # returns is kept in `opened_note` for the scenario's events.
        self.before_open: Callable[[], str] | None = None
        self.opened_note = ""

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

    def local(self, *command: str | int) -> Any:
        """One command on the Unix socket (answers before the TCP port is open)."""
        return unix_command(self.socket_path, self.password, *command)

    def start(self) -> None:
        """Start the server (loading what stop() saved), wait until it answers PING on its
        socket, run `before_open`, then open the TCP port."""
        argv = [
            "redis-server",
            "--port", "0",  # opened by CONFIG SET below
            "--unixsocket", self.socket_path,
            "--unixsocketperm", "700",
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
            with contextlib.suppress(OSError, RespError):
                if self.local("PING") == b"PONG":
                    break
            time.sleep(POLL)
        else:
            raise RuntimeError(f"redis-server did not answer within {REDIS_START_TIMEOUT}s")
        if self.before_open is not None:
            self.opened_note = self.before_open()
        self.local("CONFIG", "SET", "port", self.port)

    def stop(self) -> None:
        """SIGTERM, which (--shutdown-on-sigterm save) refuses clients, saves, and exits.

        What the broker had accepted survives the restart, as it would on a durable broker;
        the fault under test is the relay's view (nothing answers for a while), not a broker
        that forgets messages it acknowledged. The replies to the last commands it ran, and
        their MONITOR lines, may never be sent: a relay then publishes again what the saved
        lists already hold (chaos.brokerwatch counts those copies from the lists).
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


class RespError(Exception):
    """An error reply of redis-server."""


def unix_command(path: str, password: str, *command: str | int) -> Any:
    """AUTH, then `command`, on redis-server's Unix socket; the command's reply (bytes, int,
    list or None). redis-py is not used: its 4.5 releases cannot open a Unix socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(_encode("AUTH", password) + _encode(*command))
        reader = sock.makefile("rb")
        _reply(reader)
        return _reply(reader)


def _encode(*parts: str | int) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _reply(reader: Any) -> Any:
    line = reader.readline()
    if not line.endswith(b"\r\n"):
        raise OSError("redis-server closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RespError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = reader.read(size + 2)
        if len(data) != size + 2:
            raise OSError("redis-server closed the connection")
        return data[:-2]
    if kind == b"*":
        size = int(rest)
        return None if size < 0 else [_reply(reader) for _ in range(size)]
    raise OSError(f"unexpected reply from redis-server: {line[:40]!r}")


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
