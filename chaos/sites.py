"""A broker as the chaos run sees it: its private server, its watch, its queues, its worker.

Each scenario runs on one site (Redis or RabbitMQ). The harness asks a site for the URL its
relays and worker use, what the broker really received (the watch), what is still queued,
and which secrets must never appear in a log; the faults act on the site's server.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from typing import Any, Protocol

from chaos import brokerwatch, firehose
from chaos.rabbit import ChaosRabbit
from chaos.services import PrivateRedis
from chaos.transport import RESTORE_MUTEX_KEY

REDIS = "redis"
RABBITMQ = "rabbitmq"


class Site(Protocol):
    """What the harness needs from a broker."""

    kind: str
    label: str

    def url(self) -> str: ...
    def secrets(self) -> dict[str, str]: ...
    def start_watch(self) -> None: ...
    def stop_watch(self) -> None: ...
    def snapshot(self) -> tuple[Counter[str], set[str]]: ...
    def received(self) -> Counter[str]: ...
    def redelivered(self) -> set[str]: ...
    def pending(self, queues: list[str]) -> int: ...
    def settled(self, queues: list[str]) -> bool: ...
    def depth(self, queue: str) -> int: ...
    def leftover(self, queues: list[str]) -> dict[str, Any]: ...


class RedisSite:
    """The private redis-server, watched with MONITOR."""

    kind = REDIS
    label = "Redis"

    def __init__(self, server: PrivateRedis, queue: str) -> None:
        self.server = server
        self.watch = brokerwatch.BrokerWatch(server.socket_path, server.password, queue)
        server.before_open = self.watch.catch_up  # a restart: no gap in what MONITOR sees

    def url(self) -> str:
        return self.server.url()

    def secrets(self) -> dict[str, str]:
        return {"Redis password": self.server.password}

    def start_watch(self) -> None:
        self.watch.start()
        brokerwatch.wait_started(self.watch)

    def stop_watch(self) -> None:
        self.watch.stop()

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        """(copies stored per task id, task ids a worker took unacknowledged)."""
        return self.watch.snapshot()

    def received(self) -> Counter[str]:
        return self.watch.snapshot()[0]

    def redelivered(self) -> set[str]:
        """Task ids kombu put back into the list (unacknowledged past the visibility timeout)."""
        with self.watch.lock:
            return set(self.watch.restored)

    def pending(self, queues: list[str]) -> int:
        client = self.server.client()
        return sum(int(client.llen(q)) for q in queues) + int(client.hlen("unacked"))

    def settled(self, queues: list[str]) -> bool:
        return self.pending(queues) == 0

    def depth(self, queue: str) -> int:
        return int(self.server.client().llen(queue))

    def leftover(self, queues: list[str]) -> dict[str, Any]:
        """What Redis still holds for the workers: queued, unacknowledged (with their task
        ids), and how long kombu's restore lock has left (None: nobody holds it)."""
        client = self.server.client()
        task_ids = sorted(_unacked_task_id(value) for value in client.hvals("unacked"))
        ttl_ms = int(client.pttl(RESTORE_MUTEX_KEY))
        return {
            "queued": sum(int(client.llen(q)) for q in queues),
            "unacknowledged": len(task_ids),
            "unacknowledged_task_ids": task_ids,
            "restore_lock_ttl_s": round(ttl_ms / 1000, 1) if ttl_ms >= 0 else None,
        }


def _unacked_task_id(value: bytes) -> str:
    """The task id of one entry of kombu's `unacked` hash: [message, exchange, routing key]."""
    try:
        return str(json.loads(value)[0]["headers"]["id"])
    except (ValueError, LookupError, TypeError):
        return "?"


class RabbitSite:
    """The private RabbitMQ node, watched through its firehose."""

    kind = RABBITMQ
    label = "RabbitMQ"

    def __init__(self, rabbit: ChaosRabbit) -> None:
        self.rabbit = rabbit
        self.watch = firehose.FirehoseWatch(rabbit)
        # One connection for the depth probes (the sampler's thread and the drain check),
        # opened again after a fault closed it: a connection per probe would churn the node.
        self.probe: Any = None
        self.probe_lock = threading.Lock()

    def url(self) -> str:
        return self.rabbit.url()

    def secrets(self) -> dict[str, str]:
        return {"RabbitMQ password": self.rabbit.password}

    def start_watch(self) -> None:
        self.watch.start()
        firehose.wait_started(self.watch)

    def stop_watch(self) -> None:
        self.watch.stop()
        with self.probe_lock:
            self._drop_probe()

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        """(copies the node stored per task id, task ids delivered to a worker)."""
        return self.watch.snapshot()

    def received(self) -> Counter[str]:
        return self.watch.received_copy()

    def redelivered(self) -> set[str]:
        """Task ids the node delivered again (requeued after a consumer lost its channel)."""
        return self.watch.redelivered_copy()

    def _ready(self, channel: Any, queue: str) -> int:
        import amqp

        try:
            return int(channel.queue_declare(queue, passive=True).message_count)
        except amqp.exceptions.NotFound:
            return 0  # never declared: nothing was ever published to it
        finally:
            with contextlib.suppress(Exception):
                channel.close()

    def pending(self, queues: list[str]) -> int:
        """Ready messages (a passive declare per queue: cheap, but blind to unacked ones)."""
        with self.probe_lock:
            try:
                if self.probe is None:
                    self.probe = self.rabbit.connect()
                return sum(self._ready(self.probe.channel(), q) for q in queues)
            except Exception:
                self._drop_probe()
                raise

    def _drop_probe(self) -> None:
        probe, self.probe = self.probe, None
        if probe is not None:
            with contextlib.suppress(Exception):
                probe.collect()

    def settled(self, queues: list[str]) -> bool:
        """Nothing ready and nothing unacknowledged (rabbitmqctl list_queues: authoritative)."""
        return self.rabbit.messages(queues) == 0

    def depth(self, queue: str) -> int:
        return self.pending([queue])

    def leftover(self, queues: list[str]) -> dict[str, Any]:
        """Messages ready or unacknowledged in the node's queues."""
        return {"messages": self.rabbit.messages(queues)}
