"""The broker side of a Consumer: receive, acknowledge after commit, retry, dead-letter, reconnect.

One thread, one kombu connection, one channel. Each message is acknowledged only once what it
became is final:

- handled or skipped: its transaction has committed (or its id had been), then `ack`;
- the handler failed: a copy goes back to the consumer's own queue (through the default
  exchange) with the attempt number and the time it may run again in its headers, then the
  original is acked. The count travels with the message, so a restarted consumer neither
  forgets it nor retries forever. A copy that arrives early waits unacknowledged in memory
  (up to `prefetch` messages) while the others flow past it;
- after `max_attempts` failed runs, or at once when undecodable or without a handler, the
  message goes to the dead-letter exchange with its reason in the headers, then it is acked.

Publishes wait for the broker's confirmation on RabbitMQ (publisher confirms); on Redis they
are a synchronous LPUSH. A broker outage drops the connection and every unacknowledged message
with it (the broker redelivers them); a database outage keeps the message in hand and retries
it after a pause. Neither counts as an attempt.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import math
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kombu
import structlog
from django.db import DatabaseError, InterfaceError, OperationalError, connections
from kombu.message import Message

from outbox_notify import conf, observability, signals
from outbox_notify.events.consumer import Consumer, Outcome, Result

log = structlog.get_logger("outbox_notify")

# Headers of a retried copy.
ATTEMPT = "x-outbox-attempt"  # the run this delivery is (1 when absent)
RETRY_AT = "x-outbox-retry-at"  # Unix time (seconds, float) before which it must not run
LAST_ERROR = "x-outbox-last-error"  # the previous run's error, one line
ORIGINAL_EXCHANGE = "x-outbox-original-exchange"
ORIGINAL_ROUTING_KEY = "x-outbox-original-routing-key"
# Headers a dead letter adds.
DEAD_REASON = "x-outbox-dead-letter-reason"
DEAD_KIND = "x-outbox-dead-letter-kind"  # "undecodable" or "handler-failed"
DEAD_ATTEMPTS = "x-outbox-attempts"  # handler runs that failed (0 when undecodable)
DEAD_CONSUMER = "x-outbox-consumer"
DEAD_QUEUE = "x-outbox-queue"
DEAD_AT = "x-outbox-dead-at"  # RFC 3339, UTC
RETRY_HEADERS = (ATTEMPT, RETRY_AT, LAST_ERROR)

MAX_REASON = 1000  # characters of a reason kept in a header
# Seconds the loop waits for a message before it checks for a stop request. Below kombu's
# Redis BRPOP timeout (1 s): kombu sweeps the unacknowledged messages of dead consumers back
# onto their queue only when a wait ends with nothing read, which a wait as long as the BRPOP
# itself rarely does (kombu 5.7).
POLL = 0.5
STOP_CHECK = 0.1  # seconds: how soon a pause notices a stop request
OUTAGE_COOLDOWN = 2.0  # seconds between attempts to reach a broker or database that is down
# runs of one message that lost their database session while the database answered, kept in
# hand as an outage before the next one counts as the handler's failure (see deliver())
LOST_SESSIONS_IN_HAND = 3
LOST_SESSION = ("08", "57P", "53300")  # SQLSTATE prefixes of a session lost or refused

__all__ = ["DEAD_REASON", "Runner"]


class DatabaseDown(Exception):
    """The outbox database cannot be reached: keep the message and try again later."""


class Runner:
    """Runs one Consumer until `request_stop()`: the current message is finished first."""

    def __init__(
        self,
        consumer: Consumer,
        *,
        outage_cooldown: float = OUTAGE_COOLDOWN,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.consumer = consumer
        self.outage_cooldown = outage_cooldown
        self.clock = clock
        self._stop_requested = False
        self._sequence = itertools.count()

    def request_stop(self) -> None:
        """Ask the loop to stop after the message in hand.

        Called from the SIGTERM handler, which runs between two bytecodes of the main thread:
        so it only sets a flag. (A threading.Event takes a lock that is not reentrant, which
        that thread may hold at that moment inside Event.wait: set() would then wait forever.)
        """
        self._stop_requested = True

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def pause(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True as soon as a stop is requested (within STOP_CHECK)."""
        end = time.monotonic() + seconds
        while not self._stop_requested:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, STOP_CHECK))
        return True

    def connection(self) -> kombu.Connection:
        """A kombu connection to the consumer's broker (confirms on for AMQP)."""
        url, options = _broker(self.consumer)
        if kombu.Connection(url).transport.driver_type == "amqp":  # builds, does not connect
            options["confirm_publish"] = True
        return kombu.Connection(url, transport_options=options)

    def check_reachable(self) -> None:
        """Connect to the broker once; kombu's connection error if it cannot be reached."""
        with self.connection() as connection:
            connection.ensure_connection(max_retries=1)

    def run(self) -> None:
        """Consume until stopped, reconnecting after broker outages."""
        log.info("outbox.consumer_started", consumer=self.consumer.name, queue=self.consumer.queue)
        while not self.stopping:
            connection = self.connection()
            # recoverable_connection_errors holds py-amqp's MessageNacked: a refused publish
            # is the broker's trouble, not the handler's.
            outages: tuple[type[BaseException], ...] = (
                *connection.connection_errors,
                *connection.recoverable_connection_errors,
                OSError,
            )
            try:
                with connection:
                    self._session(connection)
            except outages as exc:
                log.warning("outbox.consumer_broker_unavailable", error=_one_line(exc))
                self.pause(self.outage_cooldown)
        log.info("outbox.consumer_stopped", consumer=self.consumer.name)

    def _session(self, connection: kombu.Connection) -> None:
        channel = connection.channel()
        queue = declare(self.consumer, channel)
        session = _Session(self, channel)
        # prefetch_count given here is sent before basic.consume: RabbitMQ applies a
        # per-consumer basic.qos only to consumers that start after it.
        with kombu.Consumer(
            channel,
            queues=[queue],
            on_message=session.received,
            prefetch_count=self.consumer.prefetch,
        ):
            while not self.stopping:
                if not session.step():
                    _drain(connection, session.wait_seconds())


def _drain(connection: kombu.Connection, timeout: float) -> None:
    with contextlib.suppress(socket.timeout):
        connection.drain_events(timeout=timeout)


def declare(consumer: Consumer, channel: Any) -> kombu.Queue:
    """Declare the exchange, the queue and its bindings, and the dead-letter exchange and queue."""
    exchange = kombu.Exchange(consumer.exchange, type=consumer.exchange_type, durable=True)
    bindings = [kombu.binding(exchange, routing_key=key) for key in consumer.routing_keys]
    queue = kombu.Queue(consumer.queue, bindings=bindings, durable=True, channel=channel)
    exchange.bind(channel).declare()
    queue.declare()
    dead = kombu.Exchange(consumer.dead_letter_exchange, type="topic", durable=True)
    dead_queue = kombu.Queue(consumer.dead_letter_exchange, dead, routing_key="#", durable=True)
    dead_queue.bind(channel).declare()
    return queue


class _Session:
    """The messages of one connection: received ones, and retries waiting for their time."""

    def __init__(self, runner: Runner, channel: Any) -> None:
        self.runner = runner
        self.consumer = runner.consumer
        self.producer = kombu.Producer(channel)
        self.ready: collections.deque[Message] = collections.deque()
        self.waiting: list[tuple[float, int, Message]] = []

    def received(self, message: Message) -> None:
        """kombu's on_message: only queue it (a publish may be waiting for its confirm)."""
        self.ready.append(message)

    def wait_seconds(self) -> float:
        """How long to wait for the broker: until the next retry is due, at most POLL."""
        if not self.waiting:
            return POLL
        return max(0.0, min(POLL, self.waiting[0][0] - self.runner.clock()))

    def step(self) -> bool:
        """Deliver one message that is ready; False when there was none."""
        now = self.runner.clock()
        while self.waiting and self.waiting[0][0] <= now:
            self.ready.append(heapq.heappop(self.waiting)[2])
        if not self.ready:
            return False
        message = self.ready.popleft()
        due = _number(headers_of(message).get(RETRY_AT), 0.0)
        if due > now:
            heapq.heappush(self.waiting, (due, next(self.runner._sequence), message))
        else:
            self.deliver(message)
        return True

    def deliver(self, message: Message) -> None:
        """Process one due message until its outcome is final, then acknowledge it.

        A run that lost its database session is an outage, kept in hand without spending an
        attempt, while the database does not answer. When it answers and this message's runs
        keep losing their session (a handler over a pooler's query_timeout, a watchdog that
        terminates it), the loss is the handler's: after LOST_SESSIONS_IN_HAND such runs the
        failure counts as an attempt, so the message retries and ends dead-lettered instead
        of holding the consumer forever.
        """
        lost_while_up = 0
        while True:
            result = self.consumer.process(message.body or b"")
            if result.outcome is not Outcome.FAILED or not _database_down(result.error):
                break
            if _database_answers():
                lost_while_up += 1
                if lost_while_up >= LOST_SESSIONS_IN_HAND:
                    break
            log.warning("outbox.consumer_database_unavailable", error=result.reason)
            if self.runner.pause(self.runner.outage_cooldown):
                return  # stopping: unacknowledged, the broker delivers it again
        self.settle(message, result)

    def settle(self, message: Message, result: Result) -> None:
        attempt = max(1, int(_number(headers_of(message).get(ATTEMPT), 1)))
        if result.outcome is Outcome.FAILED and attempt < self.consumer.max_attempts:
            self.retry(message, result, attempt)
        elif result.outcome is Outcome.FAILED:
            reason = f"handler failed {attempt} times; last error: {result.reason}"
            self.dead_letter(message, result, "handler-failed", reason, attempt)
        elif result.outcome is Outcome.UNDECODABLE:
            self.dead_letter(message, result, "undecodable", result.reason or "", 0)
        else:
            log.debug(
                "outbox.event_" + result.outcome.value,
                consumer=self.consumer.name,
                event_id=result.event_id,
                event_type=result.event_type,
            )
        message.ack()

    def retry(self, message: Message, result: Result, attempt: int) -> None:
        """Send a copy for the next run back to the consumer's queue; the caller acks."""
        delay = min(self.consumer.backoff * 2 ** (attempt - 1), self.consumer.max_backoff)
        headers = _origin(message)
        headers.update(
            {
                ATTEMPT: attempt + 1,
                RETRY_AT: self.runner.clock() + delay,
                LAST_ERROR: _clip(result.reason or ""),
            }
        )
        self.publish(message, headers, exchange="", routing_key=self.consumer.queue)
        log.warning(
            "outbox.event_retry_scheduled",
            consumer=self.consumer.name,
            event_id=result.event_id,
            event_type=result.event_type,
            attempt=attempt,
            delay=delay,
            error=result.reason,
        )

    def dead_letter(
        self, message: Message, result: Result, kind: str, reason: str, attempts: int
    ) -> None:
        """Publish the message unchanged to the dead-letter exchange with why; the caller acks."""
        headers = _origin(message)
        for name in RETRY_HEADERS:
            headers.pop(name, None)
        headers.update(
            {
                DEAD_REASON: _clip(reason),
                DEAD_KIND: kind,
                DEAD_ATTEMPTS: attempts,
                DEAD_CONSUMER: self.consumer.name,
                DEAD_QUEUE: self.consumer.queue,
                DEAD_AT: datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            }
        )
        routing_key = str(headers[ORIGINAL_ROUTING_KEY])
        self.publish(
            message, headers, exchange=self.consumer.dead_letter_exchange, routing_key=routing_key
        )
        log.error(
            "outbox.event_dead_lettered",
            consumer=self.consumer.name,
            event_id=result.event_id,
            event_type=result.event_type,
            kind=kind,
            reason=reason,
        )
        observability.send_signal(
            signals.outbox_event_dead_lettered,
            event_id=result.event_id,
            event_type=result.event_type,
            consumer=self.consumer.name,
            reason=reason,
        )

    def publish(
        self, message: Message, headers: dict[str, Any], *, exchange: str, routing_key: str
    ) -> None:
        """The body as received, persistent; confirmed by RabbitMQ before this returns."""
        republish(self.producer, message, headers, exchange=exchange, routing_key=routing_key)


def republish(
    producer: kombu.Producer,
    message: Message,
    headers: dict[str, Any],
    *,
    exchange: str,
    routing_key: str,
) -> None:
    """Publish a received message's body as it came, with these headers: persistent, and
    confirmed by RabbitMQ before this returns (a retry, a dead letter, a replay)."""
    producer.publish(
        message.body,
        exchange=exchange,
        routing_key=routing_key,
        headers=headers,
        content_type=message.content_type or "application/octet-stream",
        content_encoding=message.content_encoding or "binary",
        delivery_mode=2,
        retry=False,
    )


def headers_of(message: Message) -> dict[str, Any]:
    """A copy of a received message's headers (empty when it has none)."""
    return dict(message.headers or {})


def _origin(message: Message) -> dict[str, Any]:
    """The message's headers, with where it was first published (kept across retries)."""
    headers = headers_of(message)
    info = message.delivery_info or {}
    headers.setdefault(ORIGINAL_EXCHANGE, str(info.get("exchange") or ""))
    headers.setdefault(ORIGINAL_ROUTING_KEY, str(info.get("routing_key") or ""))
    return headers


def _number(value: Any, default: float) -> float:
    """A header's number, or the default when it is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return default
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return default
    return number if math.isfinite(number) else default


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 1] + "…"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _database_answers() -> bool:
    """Whether a fresh connection to the outbox database works right now."""
    connection = connections[conf.database_alias()]
    with contextlib.suppress(DatabaseError, InterfaceError):
        connection.close()
    try:
        connection.ensure_connection()
        return bool(connection.is_usable())
    except (DatabaseError, InterfaceError):
        return False


def _database_down(error: BaseException | None) -> bool:
    """Whether a failed run met a database outage, not a handler failure.

    An outage is a connection that broke or could not be made: an InterfaceError, or an
    OperationalError without an SQLSTATE (libpq's own) or with one of a lost session (class 08,
    57P01-57P03 shutdowns, 53300 too many connections). A statement timeout (57014) or a
    deadlock (40P01) is the handler's failure. Either way the connection is closed, so the next
    run connects afresh; an outage keeps the message in hand, with no attempt spent.
    """
    if isinstance(error, OperationalError):
        state = getattr(error.__cause__, "sqlstate", None)
        down = state is None or str(state).startswith(LOST_SESSION)
    elif isinstance(error, InterfaceError):
        down = True
    else:
        return False
    connections[conf.database_alias()].close()
    return down


def _broker(consumer: Consumer) -> tuple[str, dict[str, Any]]:
    """The broker URL and transport options: the consumer's, else the configured Celery app's."""
    if consumer.broker_url is not None:
        return consumer.broker_url, dict(consumer.transport_options)
    app_conf = conf.celery_app().conf
    options = dict(app_conf.broker_transport_options or {})
    options.update(consumer.transport_options)
    return str(app_conf.broker_write_url or app_conf.broker_url), options
