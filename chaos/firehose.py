"""Watches the private RabbitMQ node's firehose: what it received, and what it really stored.

The node copies every publish it receives (`publish.<exchange>`) and every delivery it makes
(`deliver.<queue>`, with a `redelivered` count) to the `amq.rabbitmq.trace` exchange. A
quorum queue (it keeps even these transient copies through a restart) bound to both collects
them; this thread consumes it with acknowledgements, so a connection the faults close (or a
node restart) loses no trace it had not yet read. The price: a trace read just before its
acknowledgement was lost is read again and counted twice. That can only turn a duplicate
redelivered by the broker into one counted as published twice (still traced), never make a
duplicate untraced or a message lost.

- received: publishes per task id (copies the node was handed, refused ones included: a
  queue at its length limit with `reject-publish` refuses a message after it was traced);
- stored: first deliveries per task id (redelivered = 0): copies the node accepted into a
  queue and handed to a worker. Two means the relays published the message twice;
- taken: task ids delivered at least once.

This is the ground truth the accounting needs on RabbitMQ, as Redis's MONITOR is on Redis.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from typing import Any

from chaos.rabbit import ChaosRabbit

TRACE_EXCHANGE = "amq.rabbitmq.trace"
TRACE_QUEUE = "chaos-firehose"
RETRY = 0.2  # seconds between reconnection attempts while the node is down
READ_TIMEOUT = 0.5  # seconds between checks of the stop flag


def task_id(headers: dict[str, Any]) -> str | None:
    """The Celery task id of a traced message (its `id` header, else its correlation id)."""
    properties = headers.get("properties") or {}
    inner = properties.get("headers") or {}
    found = inner.get("id") or properties.get("correlation_id")
    return str(found) if found else None


class FirehoseWatch(threading.Thread):
    """A consumer of the firehose (reconnected after each fault) counting task ids."""

    def __init__(self, rabbit: ChaosRabbit) -> None:
        super().__init__(name="firehose-watch", daemon=True)
        self.rabbit = rabbit
        self.received: Counter[str] = Counter()
        self.stored: Counter[str] = Counter()
        self.taken: set[str] = set()
        self.redelivered: set[str] = set()
        self.sessions = 0
        self.done = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(Exception):  # the node may be stopped, frozen, closing
                self._watch_once()
            self.done.wait(RETRY)

    def _watch_once(self) -> None:
        conn = self.rabbit.connect()
        try:
            channel = conn.channel()
            # A quorum queue: the firehose's copies are transient messages, which a classic
            # queue drops at a node restart (traces made just before a stop, not yet read).
            channel.queue_declare(
                TRACE_QUEUE, durable=True, auto_delete=False,
                arguments={"x-queue-type": "quorum"},
            )  # fmt: skip
            for key in ("publish.#", "deliver.#"):
                channel.queue_bind(TRACE_QUEUE, TRACE_EXCHANGE, key)
            channel.basic_qos(0, 1000, False)
            channel.basic_consume(TRACE_QUEUE, callback=self._on_trace)
            self.sessions += 1
            while not self.done.is_set():
                with contextlib.suppress(socket.timeout, TimeoutError):
                    conn.drain_events(timeout=READ_TIMEOUT)
        finally:
            with contextlib.suppress(Exception):
                conn.collect()

    def _on_trace(self, message: Any) -> None:
        headers = message.properties.get("application_headers") or {}
        found = task_id(headers)
        kind = str(message.delivery_info.get("routing_key", "")).split(".", 1)[0]
        if found is not None:
            with self.lock:
                self._count(kind, found, int(headers.get("redelivered") or 0))
        message.channel.basic_ack(message.delivery_tag)

    def _count(self, kind: str, found: str, redelivered: int) -> None:
        if kind == "publish":
            self.received[found] += 1
        elif kind == "deliver":
            self.taken.add(found)
            if redelivered:
                self.redelivered.add(found)
            else:
                self.stored[found] += 1

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        """(copies the node stored per task id, task ids delivered to a worker)."""
        with self.lock:
            return Counter(self.stored), set(self.taken)

    def redelivered_copy(self) -> set[str]:
        """Task ids delivered again (a redelivered count above 0)."""
        with self.lock:
            return set(self.redelivered)

    def received_copy(self) -> Counter[str]:
        """Publishes the node received per task id (refused ones included)."""
        with self.lock:
            return Counter(self.received)


def wait_started(watch: FirehoseWatch, timeout: float = 20.0) -> None:
    """Return once the watch consumes the firehose."""
    deadline = time.monotonic() + timeout
    while watch.sessions == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if watch.sessions == 0:
        raise RuntimeError("the firehose watch never connected to the private RabbitMQ node")
