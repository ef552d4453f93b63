"""Steps inside a claim end within its budget, whatever the broker or the server does.

A claim must not outlive --stale-timeout while the relay is alive, or the server frees rows
whose messages went out and another relay publishes them again (docs/concepts.md, "The
claim window"). Each test drives one step that used to have no overall deadline against a
real RabbitMQ or PostgreSQL.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import celery
import psycopg
import pytest

from outbox_notify.relay import messages
from outbox_notify.relay.amqp_publisher import AmqpConfirmPublisher
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.publisher import KombuPublisher, PublishDeadline, Result
from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.store import ClaimStore, ClaimWouldWait
from outbox_notify.relay.timing import SystemClock
from outbox_notify.serialization import SCHEMA_VERSION
from tests.integration.test_fast_path import claimed

CHUNK = 256  # bytes the proxy passes on at a time, client to broker
DRIP = 0.01  # seconds between two chunks: about 25 kB/s


class ThrottlingProxy:
    """A TCP proxy to the broker: the broker's bytes pass at once, the client's at about
    CHUNK / DRIP bytes a second, through small socket buffers, so a large write drips."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self.closed.is_set():
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
                threading.Thread(
                    target=self._pipe, args=(upstream, client, 0.0), daemon=True
                ).start()
                threading.Thread(
                    target=self._pipe, args=(client, upstream, DRIP), daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, pause: float) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(CHUNK if pause else 65536):
                sink.sendall(data)
                time.sleep(pause)

    def close(self) -> None:
        self.closed.set()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def slow_link(amqp_url: str) -> Iterator[str]:
    """The broker URL through a ThrottlingProxy."""
    parts = urlsplit(amqp_url)
    proxy = ThrottlingProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    try:
        yield amqp_url.replace(f"{parts.hostname}:{parts.port or 5672}", f"127.0.0.1:{proxy.port}")
    finally:
        proxy.close()


@pytest.mark.rabbitmq
def test_a_broker_that_takes_a_few_bytes_at_a_time_cannot_stretch_a_write(
    slow_link: str, queue_name: str
) -> None:
    """A group's writes end within --send-timeout even when every system call makes a little
    progress (py-amqp's write timeout bounds each call, not the write): the rest is an
    outage, nothing is lost, and the claim's budget holds."""
    app = celery.Celery("claim-budget", broker=slow_link, set_as_current=False)
    publisher = AmqpConfirmPublisher(KombuPublisher(app, send_timeout=1.0))
    try:
        publisher.check()
        assert publisher.session is not None
        sock = publisher.session.raw.transport.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        # py-amqp sets TCP_USER_TIMEOUT (1 s) where the platform has it, which aborts the
        # connection while the broker's window stays closed; a broker that keeps taking a
        # little (or macOS, which has no such option) is what is left: turn it off.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)
        now = dt.datetime.now(dt.UTC)
        payload = "x" * 2000
        row = claimed(queue_name, headers={"pad": payload})
        batch = [messages.prepare(row, now) for _ in range(600)]
        deadline = PublishDeadline(
            clock=SystemClock(), claim_end=time.monotonic() + 27.0, stop_end=lambda: None
        )
        started = time.monotonic()
        attempts = publisher.publish(batch, deadline)
        elapsed = time.monotonic() - started
    finally:
        publisher.close()
    # One of the publisher's 256 kB writes takes 10 s at about 25 kB/s, each system call
    # making progress; the write now gives up after 1 s, and the confirms of what went out
    # are awaited for one more (a generous margin for a busy host).
    assert elapsed < 6.0, elapsed
    results = {a.result for a in attempts}
    assert Result.OUTAGE in results, results
    assert Result.FAILED not in results, results


@pytest.mark.django_db(transaction=True)
def test_a_claim_beside_another_gives_up_when_its_statement_runs_long() -> None:
    """A claim made while the relay holds another gives up after its wait whatever slows it
    (here: 50,000 dead rows an old snapshot keeps, read by a relay that starts from nothing),
    and the connection stays usable."""
    # transaction=True: the rows are written, deleted and claimed by sessions of their own.
    with psycopg.connect(**connection_kwargs("default"), autocommit=False) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        with psycopg.connect(**connection_kwargs("default"), autocommit=True) as writer:
            writer.execute(
                "INSERT INTO outbox_notify_message_v1"
                " (task_id, task_name, args, kwargs, options, schema_version)"
                " SELECT 'b-' || n, 'tests.add', '[]', '{}', '{}', %s"
                " FROM generate_series(1, 50000) AS n",
                [SCHEMA_VERSION],
            )
            writer.execute("DELETE FROM outbox_notify_message_v1")
            writer.execute("DELETE FROM outbox_notify_frontier_v1")
        store = ClaimStore(connection_kwargs("default"), stale_timeout=30, frontier=Frontier())
        store.connect()
        try:
            with pytest.raises(ClaimWouldWait), store.claim(10, lock_wait=0.001):
                pass
            with store.claim(10) as claim:  # the same connection, after the give-up
                assert claim.rows == []
        finally:
            store.close()
