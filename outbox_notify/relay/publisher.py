"""The publisher: the only module that talks to the broker.

Broker errors are classified here, and only here: an outage (the broker cannot be reached)
defers messages without spending their retries; anything else is an ordinary failure of
that one message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import structlog
from kombu import Connection, Producer
from kombu.exceptions import OperationalError

from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay.messages import JSON_CONTENT_TYPE, OutgoingMessage

log = structlog.get_logger("outbox_notify")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    ConnectionError,
    TimeoutError,
    socket.timeout,
    OSError,
)


class Result(enum.Enum):
    """What happened to one message."""

    PUBLISHED = "published"  # the broker has it: delete the row
    FAILED = "failed"  # this message failed while the broker answered: spend a retry
    OUTAGE = "outage"  # the broker could not be reached: retry later, retries unspent
    SKIPPED = "skipped"  # not attempted (deadline or shutdown): release untouched


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """The result of one message's publish, with the error text when it did not go out."""

    result: Result
    error: str | None = None
    # True for the message whose own publish broke the connection (not merely after it).
    blamed: bool = False


class Publisher(Protocol):
    """Publishes batches of prepared messages."""

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]: ...
    def check(self) -> None: ...
    def close(self) -> None: ...


def _transport_options(driver: str, timeout: float) -> dict[str, Any]:
    if driver == "redis":
        return {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if driver == "amqp":
        # Publisher confirms: publish() returns only once RabbitMQ has the message.
        return {"confirm_publish": True, "read_timeout": timeout, "write_timeout": timeout}
    return {}


# Error replies with which a broker refuses every write, not this message: out of memory,
# a failed snapshot (MISCONF), a replica or demoted primary (READONLY), too few replicas,
# still loading, cluster down. Matched by the reply's first word so no client is imported.
_REFUSING_MESSAGES = (
    "command not allowed when used memory",
    "MISCONF",
    "READONLY",
    "You can't write against a read only",
    "NOREPLICAS",
    "Redis is loading",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
)


def broker_refuses_writes(exc: BaseException) -> bool:
    """Whether an error reply means the broker refuses all writes (an outage, not this message)."""
    name = type(exc).__name__
    if name in (
        "OutOfMemoryError",
        "ReadOnlyError",
        "BusyLoadingError",
        "MasterDownError",
        "ClusterDownError",
        "TryAgainError",
    ):
        return True
    text = str(exc)
    return any(text.startswith(marker) or marker in text[:80] for marker in _REFUSING_MESSAGES)


def error_text(exc: BaseException) -> str:
    """An exception as one line of text for logs and last_error."""
    return f"{type(exc).__name__}: {exc}"[:2000]


class KombuPublisher:
    """Publishes through kombu on one long-lived connection of the relay's Celery app."""

    def __init__(self, app: Any, *, send_timeout: float) -> None:
        self.app = app
        self.send_timeout = send_timeout
        self.conn: Connection | None = None
        self.producer: Producer | None = None
        self.outage_errors: tuple[type[BaseException], ...] = OUTAGE_ERRORS

    def connect(self) -> Producer:
        """The producer on the live connection, connecting first when needed."""
        if self.producer is not None:
            return self.producer
        conn = self.app.connection_for_write(connect_timeout=self.send_timeout)
        options = {
            **conn.transport_options,
            **_transport_options(conn.transport.driver_type, self.send_timeout),
        }
        conn = self.app.connection_for_write(
            connect_timeout=self.send_timeout, transport_options=options
        )
        try:
            conn.ensure_connection(max_retries=1, timeout=self.send_timeout)
            producer = Producer(conn.default_channel, auto_declare=False)
        except Exception as exc:
            with contextlib.suppress(Exception):
                conn.release()
            raise BrokerUnavailable(f"cannot connect to the broker: {error_text(exc)}") from exc
        # kombu's Redis transport counts KeyError as a connection error; here it is what an
        # unknown compression or serializer raises for one message, so it stays ordinary.
        extra = tuple(e for e in conn.connection_errors if not issubclass(e, LookupError))
        self.outage_errors = OUTAGE_ERRORS + extra
        self.conn, self.producer = conn, producer
        log.info("outbox.broker_connected", transport=conn.transport.driver_type)
        return producer

    def check(self) -> None:
        """Raise BrokerUnavailable unless a connection to the broker can be made now."""
        self.connect()

    def close(self) -> None:
        """Drop the broker connection; the next publish reconnects."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.release()
        self.conn = None
        self.producer = None

    def _send(self, producer: Producer, message: OutgoingMessage) -> None:
        spec = message.spec
        is_json = spec.serializer == "json"
        producer.publish(
            message.body,
            exchange=spec.exchange,
            routing_key=spec.routing_key,
            serializer=None if is_json else spec.serializer,
            content_type=JSON_CONTENT_TYPE if is_json else None,
            content_encoding="utf-8" if is_json else None,
            compression=spec.compression,
            headers=message.headers,
            delivery_mode=spec.delivery_mode,
            declare=spec.declare,
            expiration=message.expiration,
            retry=False,
            timeout=self.send_timeout,
            confirm_timeout=self.send_timeout,
            **spec.properties,
        )

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Publish in order; stop at the first outage (the rest are outage too)."""
        try:
            producer = self.connect()
        except BrokerUnavailable as exc:
            return [Attempt(Result.OUTAGE, str(exc))] * len(messages)
        batch = getattr(producer, "batch", None)
        if (
            batch is not None
            and self.conn is not None
            and self.conn.transport.driver_type == "redis"
        ):
            return self._publish_pipelined(producer, messages, deadline)
        return self._publish_each(producer, messages, deadline)

    def _publish_each(
        self, producer: Producer, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        attempts: list[Attempt] = []
        for index, message in enumerate(messages):
            if deadline():
                attempts.extend([Attempt(Result.SKIPPED)] * (len(messages) - index))
                break
            attempt = self._attempt(producer, message)
            attempts.append(attempt)
            if attempt.result is Result.OUTAGE:
                attempts.extend(
                    [Attempt(Result.OUTAGE, attempt.error)] * (len(messages) - index - 1)
                )
                break
        return attempts

    def _attempt(self, producer: Producer, message: OutgoingMessage) -> Attempt:
        try:
            with structlog.contextvars.bound_contextvars(**message.log_context):
                self._send(producer, message)
        except self.outage_errors as exc:
            self.close()
            return Attempt(Result.OUTAGE, error_text(exc), blamed=True)
        except Exception as exc:
            if broker_refuses_writes(exc):
                return Attempt(Result.OUTAGE, error_text(exc))
            self._revive_channel()
            return Attempt(Result.FAILED, error_text(exc))
        return Attempt(Result.PUBLISHED)

    def _revive_channel(self) -> None:
        # An AMQP channel error (e.g. an exchange that does not exist) closes the channel;
        # the next message needs a fresh one.
        if self.conn is None or self.producer is None:
            return
        try:
            self.producer.revive(self.conn.channel())
        except Exception:
            self.close()

    def _publish_pipelined(
        self, producer: Producer, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Redis: buffer the whole batch and send it in one round trip."""
        attempts: list[Attempt] = []
        try:
            batch: Any = cast(Any, producer).batch  # kombu >= 5.7: Redis pipelining
            with batch(max_size=len(messages) * 4 + 1):
                for index, message in enumerate(messages):
                    if deadline():
                        attempts.extend([Attempt(Result.SKIPPED)] * (len(messages) - index))
                        break
                    attempts.append(self._attempt_buffered(producer, message))
        except Exception as exc:
            # The pipeline did not go through: we cannot know which commands the server ran,
            # so every buffered message is retried later (a possible duplicate, never a loss).
            self.close()
            error = error_text(exc)
            done = [
                Attempt(Result.OUTAGE, error) if a.result is Result.PUBLISHED else a
                for a in attempts
            ]
            return done + [Attempt(Result.OUTAGE, error)] * (len(messages) - len(done))
        return attempts

    def _attempt_buffered(self, producer: Producer, message: OutgoingMessage) -> Attempt:
        try:
            with structlog.contextvars.bound_contextvars(**message.log_context):
                self._send(producer, message)
        except self.outage_errors:
            raise
        except Exception as exc:
            if broker_refuses_writes(exc):
                return Attempt(Result.OUTAGE, error_text(exc))
            return Attempt(Result.FAILED, error_text(exc))
        return Attempt(Result.PUBLISHED)
