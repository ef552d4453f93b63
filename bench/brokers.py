"""The brokers the benchmark publishes to: Redis and RabbitMQ, private servers when possible.

Redis: a private `redis-server` on a free port without persistence, else database 13 of the
one on localhost (OUTBOX_BENCH_REDIS_URL overrides both).
RabbitMQ: a private node from devtools.rabbitserver (its own name, ports and directories), so
its `beam.smp` CPU can be read and nothing touches the machine's shared RabbitMQ; without
`rabbitmq-server` installed, the RabbitMQ at OUTBOX_BENCH_AMQP_URL (default the one on
localhost), where every queue gets a name unique to this run and is deleted at the end.

Queues are declared the way Celery declares its default queue (durable, a direct exchange of
the same name), and Celery publishes persistent messages to them; the benchmark only reads
queue depths, purges and (on a shared server) deletes what it declared.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from bench.procs import BenchError, cpu_seconds
from devtools.process import stop_process

REDIS = "redis"
RABBITMQ = "rabbitmq"
KEYS = (REDIS, RABBITMQ)
LABELS = {REDIS: "Redis", RABBITMQ: "RabbitMQ"}
SHARED_REDIS_URL = "redis://127.0.0.1:6379/13"
SHARED_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_START_TIMEOUT = 10.0  # seconds
AMQP_TIMEOUT = 10.0  # seconds to connect to RabbitMQ or hear from it


class Depth(Protocol):
    """Reads and empties queues on one open broker connection."""

    def depth(self, queue: str) -> int: ...
    def purge(self, queue: str) -> None: ...
    def close(self) -> None: ...


class RedisDepth:
    """Queue depth on Redis: the length of the queue's list."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def purge(self, queue: str) -> None:
        self.client.delete(queue)

    def close(self) -> None:
        self.client.close()


def amqp_connection(url: str) -> Any:
    """An open py-amqp connection (kombu's own AMQP client) to the server of an amqp:// URL."""
    import amqp

    parts = urlsplit(url)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    conn = amqp.Connection(
        host=f"{parts.hostname or '127.0.0.1'}:{parts.port or 5672}",
        userid=unquote(parts.username or "guest"),
        password=unquote(parts.password or "guest"),
        virtual_host=vhost,
        connect_timeout=AMQP_TIMEOUT,
        read_timeout=AMQP_TIMEOUT,
        write_timeout=AMQP_TIMEOUT,
    )
    conn.connect()
    return conn


class AmqpDepth:
    """Queue depth on RabbitMQ: the ready messages a passive queue.declare reports."""

    def __init__(self, url: str) -> None:
        self.conn = amqp_connection(url)
        self.channel = self.conn.channel()

    def _on_queue(self, action: Callable[[Any], Any]) -> Any:
        import amqp

        try:
            return action(self.channel)
        except amqp.exceptions.NotFound:
            # The queue is not declared yet (nothing was published to it): empty. The error
            # closed the channel; the next call needs a new one.
            self.channel = self.conn.channel()
            return None

    def depth(self, queue: str) -> int:
        found = self._on_queue(lambda ch: ch.queue_declare(queue, passive=True))
        return int(found.message_count) if found is not None else 0

    def purge(self, queue: str) -> None:
        self._on_queue(lambda ch: ch.queue_purge(queue))

    def delete(self, queue: str) -> None:
        """Delete a queue and the exchange of the same name Celery declared with it."""
        self._on_queue(lambda ch: ch.queue_delete(queue))
        self._on_queue(lambda ch: ch.exchange_delete(queue))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def depth_reader(url: str) -> Depth:
    """A Depth for the broker of this URL (the caller closes it)."""
    if url.startswith(("amqp://", "pyamqp://")):
        return AmqpDepth(url.replace("pyamqp://", "amqp://", 1))
    return RedisDepth(url)


@dataclass(frozen=True, kw_only=True)
class Broker:
    """One broker of the run: where it is, how its queues are named, whose CPU it burns."""

    key: str  # REDIS or RABBITMQ
    url: str
    private: bool
    server: str  # how the report describes it
    pid: int | None  # the server process whose CPU is read (private servers only)
    prefix: str = ""  # with a shared server in the run, queue names are unique to the run
    version: str = "?"
    # Queues this run declared (deleted at the end when the server is a shared one).
    declared: list[str] = field(default_factory=list, compare=False)

    @property
    def label(self) -> str:
        return LABELS[self.key]

    def queue(self, name: str) -> str:
        return self.prefix + name

    def reader(self) -> Depth:
        return depth_reader(self.url)

    @contextlib.contextmanager
    def depth_of(self, queue: str) -> Iterator[Callable[[], int]]:
        """A cheap depth probe of one queue, on a connection held for the block."""
        reader = self.reader()
        try:
            yield lambda: reader.depth(queue)
        finally:
            reader.close()

    def depth(self, queue: str) -> int:
        with self.depth_of(queue) as probe:
            return probe()

    def purge(self, queue: str) -> None:
        reader = self.reader()
        try:
            reader.purge(queue)
        finally:
            reader.close()

    def cpu(self) -> float | None:
        """CPU seconds the broker's server process has used; None when it is not ours."""
        return None if self.pid is None else cpu_seconds(self.pid)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "server": self.server, "broker_cpu": self.pid is not None}


# --- Redis -------------------------------------------------------------------------------


def _wait_for_ping(url: str, proc: subprocess.Popen[bytes]) -> None:
    import redis

    deadline = time.monotonic() + REDIS_START_TIMEOUT
    client = redis.Redis.from_url(url)
    while True:
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError("the private redis-server did not start")
        time.sleep(0.05)


def _redis_version(url: str) -> str:
    import redis

    info: dict[str, Any] = redis.Redis.from_url(url).info("server")
    return str(info.get("redis_version", "?"))


@contextlib.contextmanager
def redis_broker(log_dir: Path) -> Iterator[Broker]:
    """A private redis-server for the block, or the shared one's database 13."""
    binary = shutil.which("redis-server")
    if not redis_is_private() or not binary:
        url = os.environ.get("OUTBOX_BENCH_REDIS_URL") or SHARED_REDIS_URL
        yield Broker(
            key=REDIS, url=url, private=False, server=url, pid=None, version=_redis_version(url)
        )
        return
    from devtools.pgserver import free_port

    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with (log_dir / "redis.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        _wait_for_ping(url, proc)
        yield Broker(
            key=REDIS,
            url=url,
            private=True,
            server="private redis-server, no persistence",
            pid=proc.pid,
            version=_redis_version(url),
        )
    finally:
        stop_process(proc)


# --- RabbitMQ ----------------------------------------------------------------------------


def _amqp_version(url: str) -> str:
    conn = amqp_connection(url)
    try:
        return str(conn.server_properties.get("version", "?"))
    finally:
        conn.close()


def beam_pid(node: Any) -> int | None:
    """The private node's Erlang VM (`beam.smp`), from the pid file the node writes."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((node.base / "node.pid").read_text().split()[0])
        if "beam" in Path(f"/proc/{pid}/comm").read_text():
            return pid
    return None


@contextlib.contextmanager
def rabbit_broker() -> Iterator[Callable[[], Broker]]:
    """A private RabbitMQ node, started in the background; the block gets a wait for it.

    The node takes several seconds to boot, so it starts while PostgreSQL is prepared; the
    node is destroyed when the block ends, however it ends (a start still under way is
    waited for first). Without rabbitmq-server: the shared server, with unique queue names.
    """
    from devtools import rabbitserver

    if not rabbit_is_private():
        with _shared_rabbit() as broker:
            yield lambda: broker
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rabbit-start")
    future = pool.submit(rabbitserver.start)
    found: list[Broker] = []

    def ready() -> Broker:
        if not found:
            found.append(_private_rabbit(future.result()))
        return found[0]

    try:
        yield ready
    finally:
        with contextlib.suppress(BaseException):
            future.result().destroy()  # a failed start destroyed its own node already
        pool.shutdown()


def rabbit_is_private() -> bool:
    """Whether the run's RabbitMQ will be a private node (else a shared server)."""
    from devtools import rabbitserver

    return not os.environ.get("OUTBOX_BENCH_AMQP_URL") and rabbitserver.installed()


def redis_is_private() -> bool:
    """Whether the run's Redis will be a private redis-server (else a shared server)."""
    return not os.environ.get("OUTBOX_BENCH_REDIS_URL") and bool(shutil.which("redis-server"))


def _private_rabbit(node: Any) -> Broker:
    url = node.url()
    return Broker(
        key=RABBITMQ,
        url=url,
        private=True,
        server="private node (devtools.rabbitserver), defaults but a 1 MB disk-free limit",
        pid=beam_pid(node),
        version=_amqp_version(url),
    )


@contextlib.contextmanager
def _shared_rabbit() -> Iterator[Broker]:
    url = os.environ.get("OUTBOX_BENCH_AMQP_URL") or SHARED_AMQP_URL
    try:
        version = _amqp_version(url)
    except Exception as exc:
        raise BenchError(
            f"no rabbitmq-server to start and no RabbitMQ at {url}: {exc} "
            "(install rabbitmq-server, set OUTBOX_BENCH_AMQP_URL, or pass --brokers redis)"
        ) from exc
    broker = Broker(
        key=RABBITMQ, url=url, private=False, server=url.split("@")[-1], pid=None,
        version=version,
    )  # fmt: skip
    try:
        yield broker
    finally:
        _delete_queues(url, broker.declared)


def _delete_queues(url: str, names: list[str]) -> None:
    if not names:
        return
    reader = AmqpDepth(url)
    try:
        for name in names:
            reader.delete(name)
    finally:
        reader.close()


def declare(broker: Broker, queues: list[str]) -> None:
    """Declare each queue as Celery declares its default queue (RabbitMQ; Redis needs none).

    Celery builds the queue (durable, a direct exchange of the queue's name, bound by the
    queue's name); the relays' own declarations of the same queues then match exactly.
    """
    if broker.key != RABBITMQ:
        return
    import celery

    app = celery.Celery("bench_declare", broker=broker.url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for name in queues:
            app.conf.task_default_queue = name
            app.amqp.queues[name](channel).declare()
    broker.declared.extend(q for q in queues if q not in broker.declared)
