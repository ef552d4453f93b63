"""The publisher seam, and the general path: kombu's own Producer.publish, one message at a time.

Broker errors are classified in the publishers, and only there: an outage (the broker cannot
be reached, is blocked, refuses every write, is slow, or closed the connection) defers
messages without spending their retries; a message fails only when the broker answered and
refused that message while it accepts others (relay/isolation.py for connections that break).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
from kombu import Connection, Exchange, Producer
from kombu.common import maybe_declare
from kombu.exceptions import OperationalError

from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay.config import SEND_TIMEOUTS_PER_STEP
from outbox_notify.relay.isolation import Isolation
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.timing import Clock

log = structlog.get_logger("outbox_notify")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    ConnectionError,
    TimeoutError,
    socket.timeout,
    OSError,
)
# AMQP reply codes with which a broker closes a connection for its own reasons, not for
# what we sent: CONNECTION_FORCED (an operator, a shutdown), RESOURCE_ERROR.
_BROKER_CLOSE_CODES = frozenset({320, 506})


class Result(enum.Enum):
    """What happened to one message."""

    PUBLISHED = "published"  # the broker has it: delete the row
    FAILED = "failed"  # the broker refused this message while accepting others: spend a retry
    OUTAGE = "outage"  # unreachable, blocked, refusing all writes, or no answer: retries unspent
    SKIPPED = "skipped"  # not attempted (deadline or shutdown): release untouched


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """The result of one message's publish, with the error text when it did not go out."""

    result: Result
    error: str | None = None


class Publisher(Protocol):
    """Publishes batches of prepared messages."""

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]: ...
    def check(self) -> None: ...
    def close(self) -> None: ...


class Pending(Protocol):
    """A batch written to the broker whose outcome is not known yet (see start())."""

    def wait(self) -> list[Attempt]:
        """The batch's attempts, once its confirms came in or its deadline passed."""
        ...

    def cancel(self) -> None:
        """Stop tracking the batch (its claim is being rolled back): nothing is awaited."""
        ...


@dataclasses.dataclass(eq=False)
class Done:
    """A Pending whose outcome was known when it was started."""

    attempts: list[Attempt]

    def wait(self) -> list[Attempt]:
        return self.attempts

    def cancel(self) -> None:
        return None


def overlaps(publisher: Publisher) -> bool:
    """Whether the publisher can have a second batch in flight while the first awaits its
    confirms (the RabbitMQ fast path): then the relay claims the next batch meanwhile."""
    return bool(getattr(publisher, "overlapping", False))


def can_overlap(publisher: Publisher) -> bool:
    """Whether the publisher can start another batch now without connecting to the broker
    (so a claim in flight never waits for a reconnect)."""
    ready = getattr(publisher, "can_overlap", None)
    return bool(ready()) if ready is not None else False


def start(
    publisher: Publisher, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
) -> Pending:
    """Write a batch and return without awaiting its outcome, where the publisher can; else
    publish it whole and return the outcome."""
    starter = getattr(publisher, "start", None)
    if starter is not None:
        pending: Pending = starter(messages, deadline)
        return pending
    return Done(publisher.publish(messages, deadline))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishDeadline:
    """Whether a broker step may start: it must be able to end before the claim's budget ends,
    and before the grace period of a requested stop ends.

    Called with no argument it answers the old question, "is it too late already?".
    """

    clock: Clock
    claim_end: float  # monotonic seconds
    stop_end: Callable[[], float | None]  # monotonic seconds, once a stop was requested

    def __call__(self) -> bool:
        return not self.allows(0.0)

    def allows(self, seconds: float) -> bool:
        """Whether a step that may take `seconds` may start now."""
        ends = self.clock.monotonic() + seconds
        stop_end = self.stop_end()
        return ends <= self.claim_end and (stop_end is None or ends <= stop_end)


def may_start(deadline: Callable[[], bool], seconds: float) -> bool:
    """Whether a step of this worst case may start (a plain callable: unless it is too late)."""
    allows = getattr(deadline, "allows", None)
    if allows is not None:
        return bool(allows(seconds))
    return not deadline()


def _transport_options(driver: str, timeout: float, *, confirms: bool = True) -> dict[str, Any]:
    if driver == "redis":
        return {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if driver == "amqp":
        # Publisher confirms: publish() returns only once RabbitMQ has the message.
        return {"confirm_publish": confirms, "read_timeout": timeout, "write_timeout": timeout}
    return {}


def bounded_connection(app: Any, timeout: float, *, confirms: bool = True) -> Any:
    """A kombu connection of the app's broker whose connect, reads and writes give up after
    `timeout` seconds (each), with publisher confirms on RabbitMQ unless told otherwise."""
    conn = app.connection_for_write(connect_timeout=timeout)
    driver = conn.transport.driver_type
    options = {
        **conn.transport_options,
        **_transport_options(driver, timeout, confirms=confirms),
    }
    return app.connection_for_write(connect_timeout=timeout, transport_options=options)


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
        "MessageNacked",  # RabbitMQ: a queue at its limit (reject-publish), or an internal error
    ):
        return True
    text = _reply_text(str(exc))
    return any(text.startswith(marker) or marker in text[:80] for marker in _REFUSING_MESSAGES)


# redis-py puts "Command # N (the command and its arguments) of pipeline caused error: " before
# an error inside a pipeline; releases before 5 also raise OOM as a plain ResponseError, so
# only the server's reply after that prefix tells what happened.
_PIPELINE_ERROR = " of pipeline caused error: "


def _reply_text(text: str) -> str:
    at = text.rfind(_PIPELINE_ERROR)
    return text[at + len(_PIPELINE_ERROR) :] if at >= 0 else text


def is_break(exc: BaseException) -> bool:
    """Whether a connection error may have been caused by what was being sent.

    Timeouts (a slow, frozen or blocked broker), refused connections, and connections the
    broker closed for its own reasons never are.
    """
    if isinstance(exc, TimeoutError | socket.timeout | ConnectionRefusedError | BrokerUnavailable):
        return False
    if any(cls.__name__ == "TimeoutError" for cls in type(exc).__mro__):
        return False  # redis-py's TimeoutError is not the builtin one
    if getattr(exc, "reply_code", None) in _BROKER_CLOSE_CODES:
        return False
    return "timed out" not in str(exc)


def error_text(exc: BaseException) -> str:
    """An exception as one line of text for logs and last_error."""
    return f"{type(exc).__name__}: {exc}"[:2000]


def exchange_key(exchange: Exchange) -> str:
    """How a declared exchange is remembered among the declared queue names (cannot clash)."""
    return f"\x00exchange:{exchange.name}"


def entity_names(message: OutgoingMessage) -> tuple[str, str]:
    """The exchange name and routing key a message is published with."""
    exchange = message.spec.exchange
    name = exchange.name if isinstance(exchange, Exchange) else (exchange or "")
    return name, message.spec.routing_key or ""


# kombu 5.3 has no confirm_timeout (its confirm wait uses `timeout`); passing it there would
# turn it into a message property.
_PUBLISH_TAKES_CONFIRM_TIMEOUT = "confirm_timeout" in inspect.signature(Producer.publish).parameters


class KombuPublisher:
    """Publishes through kombu on one long-lived connection of the relay's Celery app.

    The general path: any transport, any message, exactly as Celery's own producer would send
    it. Declarations and (on transports kombu emulates, such as Redis) the routing check are
    steps of their own, each started only when it can end within the claim.
    """

    def __init__(self, app: Any, *, send_timeout: float) -> None:
        self.app = app
        self.send_timeout = send_timeout
        self.step = send_timeout * SEND_TIMEOUTS_PER_STEP
        self.conn: Connection | None = None
        self.producer: Producer | None = None
        self.outage_errors: tuple[type[BaseException], ...] = OUTAGE_ERRORS
        self.isolation = Isolation()
        self.declared: set[str] = set()  # entity names declared on this connection
        self.returned: list[str] = []  # basic.return replies during the current publish
        self.reported: set[str] = set()  # fast-path fallbacks logged on this connection

    @property
    def driver(self) -> str:
        """The transport's driver type (`redis`, `amqp`, ...), without connecting."""
        conn = self.conn or self.app.connection_for_write()
        return str(conn.transport.driver_type)

    def connect(self) -> Producer:
        """The producer on the live connection, connecting first when needed."""
        if self.producer is not None:
            return self.producer
        conn = bounded_connection(self.app, self.send_timeout)
        on_return: Any = self._on_return if conn.transport.driver_type == "amqp" else None
        try:
            conn.ensure_connection(max_retries=1, timeout=self.send_timeout)
            producer = Producer(conn.default_channel, auto_declare=False, on_return=on_return)
        except Exception as exc:
            with contextlib.suppress(Exception):
                conn.release()
            raise BrokerUnavailable(f"cannot connect to the broker: {error_text(exc)}") from exc
        # kombu's Redis transport counts KeyError as a connection error; here it is what an
        # unknown compression or serializer raises for one message, so it stays ordinary.
        extra = tuple(e for e in conn.connection_errors if not issubclass(e, LookupError))
        self.outage_errors = OUTAGE_ERRORS + extra
        self.conn, self.producer = conn, producer
        self.declared, self.reported = set(), set()
        log.info("outbox.broker_connected", transport=conn.transport.driver_type)
        return producer

    def report_fallback(self, reason: str, **details: Any) -> None:
        """Log that the general path is used instead of a fast path (once per connection)."""
        if reason not in self.reported:
            self.reported.add(reason)
            log.info("outbox.fast_path_unavailable", reason=reason, **details)

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

    def abandon(self) -> None:
        """Drop a broken or unresponsive connection at once, without the closing handshake
        (which would wait up to --send-timeout more inside the claim)."""
        if self.conn is not None and self.conn.transport.driver_type == "amqp":
            with contextlib.suppress(Exception):
                self.conn.collect()  # py-amqp: closes the socket, no Connection.Close
        self.close()

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Publish one at a time; after a lost connection the rest are outage too."""
        try:
            producer = self.connect()
        except BrokerUnavailable as exc:
            return [Attempt(Result.OUTAGE, str(exc))] * len(messages)
        return self.publish_each(producer, messages, range(len(messages)), deadline)

    def publish_each(
        self,
        producer: Producer,
        messages: Sequence[OutgoingMessage],
        indices: Sequence[int],
        deadline: Callable[[], bool],
    ) -> list[Attempt]:
        """Publish messages[i] for i in indices; attempts for all of `messages` (others SKIPPED)."""
        attempts = [Attempt(Result.SKIPPED)] * len(messages)
        wanted = set(indices)
        plan = self.isolation.plan(messages)
        order = [i for group in plan for i in group if i in wanted]
        for position, index in enumerate(order):
            if not may_start(deadline, self.step):
                break
            attempt = self._attempt(producer, messages[index], deadline)
            attempts[index] = attempt
            if attempt.result is Result.OUTAGE and self.producer is None:
                lost = Attempt(Result.OUTAGE, attempt.error)
                for rest in order[position + 1 :]:
                    attempts[rest] = lost
                break
        return attempts

    def _attempt(
        self, producer: Producer, message: OutgoingMessage, deadline: Callable[[], bool]
    ) -> Attempt:
        self.returned = []
        try:
            with structlog.contextvars.bound_contextvars(**message.log_context):
                refused = self._try_send(producer, message, deadline)
        except self.outage_errors as exc:
            self.abandon()
            return self._lost(message, exc)
        except Exception as exc:
            if broker_refuses_writes(exc):
                return Attempt(Result.OUTAGE, error_text(exc))
            self._revive_channel()
            return Attempt(Result.FAILED, error_text(exc))
        if refused is not None:
            return refused
        if self.returned:
            return Attempt(Result.FAILED, self.returned[0])
        self.isolation.cleared((message.row.id,))
        return Attempt(Result.PUBLISHED)

    def _try_send(
        self, producer: Producer, message: OutgoingMessage, deadline: Callable[[], bool]
    ) -> Attempt | None:
        """Declare, check the route and publish; an attempt when it did not get that far."""
        if not self._declare(producer, message, deadline):
            return Attempt(Result.SKIPPED)
        unroutable = self._unroutable(producer, message)
        if unroutable is not None:
            return Attempt(Result.FAILED, unroutable)
        self._send(producer, message)
        return None

    def _lost(self, message: OutgoingMessage, exc: BaseException) -> Attempt:
        if is_break(exc) and self.isolation.broke((message.row.id,)):
            return Attempt(Result.FAILED, culprit_error(exc))
        return Attempt(Result.OUTAGE, error_text(exc))

    def _declare(
        self, producer: Producer, message: OutgoingMessage, deadline: Callable[[], bool]
    ) -> bool:
        """Declare the message's exchange and queues once per connection: a step each."""
        spec = message.spec
        if not self._declare_exchange(producer, message, deadline):
            return False
        if not spec.declare_json or all(q["name"] in self.declared for q in spec.declare_json):
            return True
        for entity in spec.declare:
            if entity.name in self.declared:
                continue
            if not may_start(deadline, self.step):
                return False
            channel: Any = producer.channel
            maybe_declare(entity, channel)
            self.declared.add(entity.name)
        return may_start(deadline, self.step)

    def _declare_exchange(
        self, producer: Producer, message: OutgoingMessage, deadline: Callable[[], bool]
    ) -> bool:
        """Declare a domain event's exchange, as configured, once per connection."""
        exchange = message.spec.declare_exchange
        if exchange is None or exchange_key(exchange) in self.declared:
            return True
        if not may_start(deadline, self.step):
            return False
        channel: Any = producer.channel
        exchange.declare(channel=channel)
        self.declared.add(exchange_key(exchange))
        return True

    def _unroutable(self, producer: Producer, message: OutgoingMessage) -> str | None:
        """On transports kombu emulates (Redis), why no queue would get the message, if so."""
        exchange, routing_key = entity_names(message)
        channel: Any = producer.channel
        if not exchange or not hasattr(channel, "_lookup"):
            return None  # the nameless exchange delivers to the queue named by the routing key
        kind = channel.typeof(exchange).type
        queues = [q for q in channel._lookup(exchange, routing_key) if q]
        if kind == "topic":
            queues = [q for q in queues if q != channel.deadletter_queue]
        if queues:
            return None
        return unroutable_error(exchange, routing_key)

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        self.returned.append(unroutable_error(exchange, routing_key, exc))

    def _send(self, producer: Producer, message: OutgoingMessage) -> None:
        spec = message.spec
        is_json = spec.serializer == "json"
        extra: dict[str, Any] = {}
        if self.conn is not None and self.conn.transport.driver_type == "amqp":
            extra["mandatory"] = True  # an unroutable message comes back as basic.return
        if _PUBLISH_TAKES_CONFIRM_TIMEOUT:
            extra["confirm_timeout"] = self.send_timeout
        headers = dict(message.headers) if spec.compression else message.headers
        producer.publish(
            message.body,
            exchange=spec.exchange,
            routing_key=spec.routing_key,
            serializer=None if is_json else spec.serializer,
            content_type=message.content_type if is_json else None,
            content_encoding="utf-8" if is_json else None,
            compression=spec.compression,
            headers=headers,
            delivery_mode=spec.delivery_mode,
            expiration=message.expiration,
            retry=False,
            timeout=self.send_timeout,
            **extra,
            **spec.properties,
        )

    def _revive_channel(self) -> None:
        # An AMQP channel error (e.g. an exchange that does not exist) closes the channel;
        # the next message needs a fresh one.
        if self.conn is None or self.producer is None:
            return
        if getattr(self.producer.channel, "is_open", False):
            return  # py-amqp reopens a channel the broker closed
        try:
            self.producer.revive(self.conn.channel())
        except Exception:
            self.close()


def unroutable_error(exchange: str, routing_key: str, reply: Any = None) -> str:
    """The error recorded for a message no queue would receive."""
    why = f" ({reply})" if reply is not None else ""
    return (
        f"unroutable: no queue is bound to exchange {exchange!r} for routing key "
        f"{routing_key!r}{why}; the message would have been dropped"
    )


def culprit_error(exc: BaseException) -> str:
    """The error recorded for a message whose own send keeps breaking the connection."""
    return (
        "the broker connection broke each time this message was sent, while the broker "
        f"accepted others: {error_text(exc)}"
    )
