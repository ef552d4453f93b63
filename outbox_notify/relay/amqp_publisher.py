"""The RabbitMQ fast path: a batch on one confirm-mode channel, its confirms awaited once.

kombu with `confirm_publish` sends one message and waits a round trip for its confirm before
the next (figures: docs/benchmarks.md#ceiling-publishing-to-the-broker-without-a-database).
This publisher builds every message with kombu's own pieces (the
serializer and compression Producer.publish uses, its delivery-mode and expiration rules, the
channel's own prepare_message), writes the whole batch on a channel in confirm mode with
`mandatory` set, then reads acks, nacks and returns until each delivery tag is settled or the
step's deadline passes. Each message's outcome comes from its own delivery tag (the
bookkeeping is relay/_confirm_ledger.py; this module writes frames and waits):

- ack: published; ack after a basic.return of that message: failed, unroutable;
- nack (a queue at its length limit with `reject-publish`, or a broker error): an outage;
- no confirm in time, `connection.blocked`, a lost connection: an outage. Unconfirmed
  messages may still be stored later, so they can be published twice (docs/concepts.md).

A missing exchange would close the channel with the rest of the batch on it, so named
exchanges are checked before the batch (a passive declare, once per connection and exchange),
and queues are declared once per connection, each as a step of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import amqp
import structlog
from amqp import spec as amqp_spec
from amqp.exceptions import ChannelError
from amqp.method_framing import frame_writer
from amqp.serialization import dumps as amqp_dumps
from kombu import Exchange, Producer
from kombu.common import maybe_declare
from kombu.compression import compress
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps as kombu_dumps

from outbox_notify import _compat as gates
from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay import amqp_properties
from outbox_notify.relay._confirm_ledger import (
    Confirm,
    ConfirmLedger,
    return_to_first,
    settle_each,
)
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    Done,
    KombuPublisher,
    Pending,
    Result,
    culprit_error,
    entity_names,
    error_text,
    exchange_key,
    is_break,
    may_start,
    unroutable_error,
)

log = structlog.get_logger("outbox_notify")

_PUBLISH_ARGS = "Bssbb"  # ticket, exchange, routing key, mandatory, immediate
_FLUSH_BYTES = 256 * 1024  # bytes of frames gathered before one socket write
_MESSAGE = amqp_properties.Message if amqp_properties.AVAILABLE else amqp.Message
_DEFAULT_EXCHANGE = Exchange("")
_NACKED = (
    "RabbitMQ refused the message (basic.nack): a queue at its length limit with "
    "x-overflow reject-publish, or a broker error"
)


_Sent = tuple[int, str, str, Any]  # (message index, exchange, routing key, message)


@dataclasses.dataclass(eq=False)
class _Batch(ConfirmLedger[_Sent, Attempt]):
    """A written group: its delivery tags' ledger, settled into the messages' attempts."""

    messages: Sequence[OutgoingMessage] = ()  # what the message indexes point into
    refused: dict[int, Attempt] = dataclasses.field(default_factory=dict)  # never written
    end: float = 0.0  # monotonic: when its confirms must have come

    def outcome(self, confirm: Confirm, reason: str | None) -> Attempt:
        if confirm is Confirm.NACKED:
            return Attempt(Result.OUTAGE, _NACKED)
        if confirm is Confirm.UNROUTABLE:
            return Attempt(Result.FAILED, reason)
        return Attempt(Result.PUBLISHED)

    def on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> bool:
        """Mark a message the broker returned (no queue took it); False if it is not ours."""
        return self.mark_returned(
            _returned_match(exchange, routing_key, message),
            unroutable_error(exchange, routing_key, exc),
        )


def _returned_match(exchange: str, routing_key: str, message: Any) -> Callable[[_Sent], bool]:
    """Whether a sent message is the one a basic.return brought back (it carries no tag)."""
    body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
    task_id = (message.properties.get("application_headers") or {}).get("id")

    def matches(item: _Sent) -> bool:
        _, sent_exchange, sent_key, sent = item
        if (sent_exchange, sent_key) != (exchange, routing_key) or sent.body != body:
            return False
        return bool((sent.properties.get("application_headers") or {}).get("id") == task_id)

    return matches


class _Frames:
    """Collects what py-amqp's frame writer writes (it reuses its buffer, so each is copied)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def write(self, data: Any) -> None:
        chunk = bytes(data)
        self.chunks.append(chunk)
        self.size += len(chunk)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.clear()
        return data

    def clear(self) -> None:
        self.chunks, self.size = [], 0


@dataclasses.dataclass(eq=False)
class _Session:
    """The fast path's state on one broker connection."""

    raw: Any  # amqp.Connection
    channel: Any  # in confirm mode, used for nothing else
    frames: _Frames
    writer: Any  # py-amqp's frame writer, writing into `frames`
    next_tag: int = 1
    blocked: str | None = None
    batches: list[_Batch] = dataclasses.field(default_factory=list)  # in flight, oldest first
    exchanges: set[str] = dataclasses.field(default_factory=lambda: {""})
    declared: set[str] = dataclasses.field(default_factory=set)
    publish_args: dict[tuple[str, str], bytes] = dataclasses.field(default_factory=dict)


class AmqpConfirmPublisher:
    """Publishes each batch pipelined on one confirm-mode channel (see the module docstring).

    start() writes a batch and returns before its confirms: the relay claims and writes the
    next batch while RabbitMQ stores this one (two in flight at most, each settled by its own
    delivery tags).
    """

    overlapping = True

    def __init__(self, general: KombuPublisher) -> None:
        self.general = general
        self.isolation = general.isolation
        self.send_timeout = general.send_timeout
        self.session: _Session | None = None
        self.session_of: Any = None  # the kombu producer the session belongs to

    # -- connection ----------------------------------------------------------------------

    def can_overlap(self) -> bool:
        """Whether another batch may be started now without connecting: the fast path's
        connection is up and the broker does not block publishing."""
        session = self.session
        return (
            session is not None
            and session.blocked is None
            and self.session_of is not None
            and self.general.producer is self.session_of
        )

    def check(self) -> None:
        """Connect, read what the broker announced, and refuse while it blocks publishers."""
        session = self._ready()
        if session is not None and session.blocked is not None:
            raise BrokerUnavailable(f"RabbitMQ blocks publishing: {session.blocked}")

    def close(self) -> None:
        """Drop the broker connection."""
        self.general.close()
        self.session = self.session_of = None

    def abandon(self) -> None:
        """Drop a broken or unresponsive connection without waiting for the broker."""
        self.general.abandon()
        self.session = self.session_of = None

    def _ready(self, *, reconnect: bool = True) -> _Session | None:
        """The live session (None when the gate sends everything the general way).

        A connection found dead is replaced only when `reconnect` is set (check(), before a
        claim); inside a claim it is an outage.
        """
        for attempt in range(2 if reconnect else 1):
            session = self._session(self.general.connect())
            if session is None:
                return None
            if session.batches:
                # Groups in flight: only awaiting the oldest one reads the connection, so that
                # a close or a break is seen by the code that knows which messages it hits.
                return session
            try:
                self._poll(session)
                session.raw.heartbeat_tick()
            except self.general.outage_errors as exc:
                # Gone while idle (a forced close, missed heartbeats).
                self.abandon()
                if attempt or not reconnect:
                    raise BrokerUnavailable(f"the broker connection broke: {exc}") from exc
                continue
            return session
        return None  # pragma: no cover - the loop returns or raises

    def _session(self, producer: Producer) -> _Session | None:
        if producer is self.session_of:
            return self.session
        channel: Any = producer.channel
        raw = channel.connection
        problem = gates.amqp_problem(raw, channel)
        if problem is not None:
            self.session_of, self.session = producer, None
            self.general.report_fallback(problem)
            return None
        refused: tuple[type[BaseException], ...] = (*self.general.outage_errors, ChannelError)
        try:
            confirm_channel = self._confirm_channel(raw)
        except refused as exc:
            # A broker that froze or went away between the connect and the channel, or that
            # refused the channel (a channel limit): an outage, never a dead relay. Not
            # remembered as this producer's session (None would mean "use the general path"
            # for as long as the connection lives); the next try connects again.
            self.abandon()
            raise BrokerUnavailable(f"cannot open a confirm channel: {error_text(exc)}") from exc
        frames = _Frames()
        session = _Session(
            raw=raw,
            channel=confirm_channel,
            frames=frames,
            writer=frame_writer(raw, frames),
        )
        self.session_of = producer
        raw.on_blocked = lambda reason: self._blocked(session, reason)
        raw.on_unblocked = lambda: self._blocked(session, None)
        self.session = session
        return session

    def _blocked(self, session: _Session, reason: str | None) -> None:
        session.blocked = reason
        log.warning("outbox.broker_blocked" if reason else "outbox.broker_unblocked", reason=reason)

    def _settle(self, tag: int, multiple: bool, nacked: bool) -> None:
        if self.session is not None:
            settle_each(self.session.batches, tag, multiple, nacked)

    def _returned(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        if self.session is not None:
            matches = _returned_match(exchange, routing_key, message)
            reason = unroutable_error(exchange, routing_key, exc)
            return_to_first(self.session.batches, matches, reason)

    def _poll(self, session: _Session) -> None:
        """Handle what the broker sent meanwhile (blocked, unblocked, late confirms, a close)."""
        sock = session.raw.transport.sock
        while select.select([sock], [], [], 0)[0]:
            with contextlib.suppress(TimeoutError):
                session.raw.drain_events(timeout=self.send_timeout)

    # -- publishing ----------------------------------------------------------------------

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Publish a batch; every message's attempt comes from its own confirm."""
        return self.start(messages, deadline).wait()

    def start(self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]) -> Pending:
        """Write a batch; its confirms are awaited by the returned Pending's wait().

        Only the usual case, one group, is left in flight; a batch the isolation splits into
        groups (suspects of a broken connection) is published whole here, group by group.
        """
        opened = self._open(messages, deadline)
        if isinstance(opened, Done):
            return opened
        session, producer = opened
        if session.batches and any(self._undeclared(session, m) for m in messages):
            # A declaration reads the connection: await the groups in flight first.
            for batch in list(session.batches):
                self._settle_group(session, batch)
            if self.session is not session:
                return Done(
                    [Attempt(Result.OUTAGE, "the broker connection was lost")] * len(messages)
                )
        try:
            attempts, ready = self._prepare(session, producer, messages, deadline)
        except self.general.outage_errors as exc:
            self.abandon()
            return Done([Attempt(Result.OUTAGE, error_text(exc))] * len(messages))
        groups = [group for group in self._groups(messages, ready) if group]
        if len(groups) == 1:
            if not may_start(deadline, self.general.step):
                return Done(attempts)
            return self._start_group(session, messages, groups[0], attempts)
        self._send_groups(session, messages, groups, deadline, attempts)
        return Done(attempts)

    def _open(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> tuple[_Session, Producer] | Done:
        """The session to write the batch on, or the batch's outcome without one."""
        try:
            session = self._ready(reconnect=self.general.producer is None)
        except BrokerUnavailable as exc:
            return Done([Attempt(Result.OUTAGE, str(exc))] * len(messages))
        producer = self.general.producer
        if producer is None:
            return Done([Attempt(Result.OUTAGE, "the broker cannot be reached")] * len(messages))
        if session is None:
            return Done(
                self.general.publish_each(producer, messages, range(len(messages)), deadline)
            )
        if session.blocked is not None:
            blocked = f"RabbitMQ blocks publishing: {session.blocked}"
            return Done([Attempt(Result.OUTAGE, blocked)] * len(messages))
        return session, producer

    def _groups(self, messages: Sequence[OutgoingMessage], ready: set[int]) -> list[list[int]]:
        groups = self.isolation.plan(messages)
        if len(ready) != len(messages):
            groups = [[i for i in group if i in ready] for group in groups]
        return groups

    def _prepare(
        self,
        session: _Session,
        producer: Producer,
        messages: Sequence[OutgoingMessage],
        deadline: Callable[[], bool],
    ) -> tuple[list[Attempt], set[int]]:
        """Declare and check exchanges: the messages ready to build; failures are theirs.

        Building each message waits for `_write`, so the broker stores the first messages
        of a batch while the relay builds the rest.
        """
        attempts = [Attempt(Result.SKIPPED)] * len(messages)
        ready: set[int] = set()
        for index, message in enumerate(messages):
            try:
                if not self._entities(session, producer, message, deadline):
                    continue  # no time left for a declaration: released untouched
                ready.add(index)
            except self.general.outage_errors:
                raise
            except Exception as exc:
                attempts[index] = Attempt(Result.FAILED, error_text(exc))
        return attempts, ready

    @staticmethod
    def _undeclared(session: _Session, message: OutgoingMessage) -> bool:
        """Whether sending the message needs a declaration or an exchange check first."""
        spec = message.spec
        declared = spec.declare_exchange
        if declared is not None and exchange_key(declared) not in session.declared:
            return True
        if spec.declare_json and not all(q["name"] in session.declared for q in spec.declare_json):
            return True
        return entity_names(message)[0] not in session.exchanges

    def _entities(
        self,
        session: _Session,
        producer: Producer,
        message: OutgoingMessage,
        deadline: Callable[[], bool],
    ) -> bool:
        """Declare the message's exchange (an event's) and queues, or check its exchange
        exists, each once a connection."""
        spec = message.spec
        channel: Any = producer.channel
        declared = spec.declare_exchange
        if declared is not None and exchange_key(declared) not in session.declared:
            if not may_start(deadline, self.general.step):
                return False
            declared.declare(channel=channel)
            session.declared.add(exchange_key(declared))
            session.exchanges.add(declared.name)
        if spec.declare_json and not all(q["name"] in session.declared for q in spec.declare_json):
            for entity in spec.declare:
                if entity.name in session.declared:
                    continue
                if not may_start(deadline, self.general.step):
                    return False
                maybe_declare(entity, channel)
                session.declared.add(entity.name)
                if entity.exchange is not None:
                    session.exchanges.add(entity.exchange.name)
        exchange, _ = entity_names(message)
        if exchange in session.exchanges:
            return True
        if not may_start(deadline, self.general.step):
            return False
        # NOT_FOUND closes the side channel (py-amqp reopens it); this message fails.
        channel.exchange_declare(exchange=exchange, type="direct", passive=True)
        session.exchanges.add(exchange)
        return True

    def _build(self, session: _Session, message: OutgoingMessage) -> tuple[str, str, Any]:
        """The message exactly as kombu's Producer.publish would build it."""
        spec = message.spec
        properties = dict(spec.properties)
        priority = properties.pop("priority", 0)
        exchange = spec.exchange or _DEFAULT_EXCHANGE
        if isinstance(exchange, Exchange):
            name, mode = exchange.name, spec.delivery_mode or exchange.delivery_mode
        else:
            name, mode = exchange, spec.delivery_mode or _DEFAULT_EXCHANGE.delivery_mode
        properties["delivery_mode"] = maybe_delivery_mode(mode)
        if message.expiration is not None:
            properties["expiration"] = str(int(message.expiration * 1000))
        headers = dict(message.headers) if spec.compression else message.headers
        if spec.serializer == "json":
            content_type, encoding, body = message.content_type, "utf-8", message.body.encode()
        else:
            content_type, encoding, body = kombu_dumps(message.body, serializer=spec.serializer)
        if spec.compression:
            body, headers["compression"] = compress(body, spec.compression)
        built = session.channel.prepare_message(
            body, priority, content_type, encoding, headers, properties, _Message=_MESSAGE
        )
        return name, spec.routing_key or "", built

    def _send_groups(
        self,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        groups: list[list[int]],
        deadline: Callable[[], bool],
        attempts: list[Attempt],
    ) -> None:
        for number, group in enumerate(groups):
            if not may_start(deadline, self.general.step):
                break
            if not self._send_group(session, messages, group, attempts):
                lost = next(
                    (a for a in (attempts[i] for i in group) if a.result is Result.OUTAGE),
                    Attempt(Result.OUTAGE, "the broker connection was lost"),
                )
                for later in groups[number + 1 :]:
                    for index in later:
                        attempts[index] = lost
                break

    def _send_group(
        self,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        group: list[int],
        attempts: list[Attempt],
    ) -> bool:
        """Write a group and await its confirms; False when the connection is gone."""
        self._start_group(session, messages, group, attempts).wait()
        return self.session is session and session.blocked is None

    def _start_group(
        self,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        group: list[int],
        attempts: list[Attempt],
    ) -> _UnconfirmedGroup:
        """Write a group; the returned batch awaits its confirms when asked."""
        started = time.monotonic()
        write_end = started + self.send_timeout
        batch = _Batch(first_tag=session.next_tag, sent=[], results=[], messages=messages)
        batch.end = started + self.general.step
        session.batches.append(batch)
        in_flight = _UnconfirmedGroup(
            owner=self,
            session=session,
            messages=messages,
            batch=batch,
            attempts=attempts,
        )
        try:
            self._write(session, messages, group, batch, write_end)
        except ChannelError as exc:
            self._channel_lost(session, exc)
        except self.general.outage_errors as exc:
            self._connection_lost(session, exc)
        return in_flight

    def _finish_group(
        self,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        batch: _Batch,
        attempts: list[Attempt],
    ) -> None:
        """Await a written group's confirms until its end; fill in its messages' attempts."""
        try:
            self._settle_group(session, batch)
        finally:
            _forget(session, batch)
        for (index, *_), result in zip(batch.sent, batch.results, strict=True):
            attempts[index] = result or Attempt(Result.SKIPPED)
        for index, refused in batch.refused.items():
            attempts[index] = refused
        if self.isolation.suspects:
            self.isolation.cleared(
                [
                    messages[i].row.id
                    for i, *_ in batch.sent
                    if attempts[i].result is Result.PUBLISHED
                ]
            )

    def _settle_group(self, session: _Session, batch: _Batch) -> None:
        """Read confirms until the group is settled or its end passes (a loss settles it too)."""
        try:
            if batch.open and self.session is not session:
                # Abandoned meanwhile (another group's timeout).
                batch.close_open(Attempt(Result.OUTAGE, "the broker connection was lost"))
            elif batch.open:
                self._await(session, batch, batch.end)
        except ChannelError as exc:
            self._channel_lost(session, exc)
        except self.general.outage_errors as exc:
            self._connection_lost(session, exc)

    def _write(
        self,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        group: list[int],
        batch: _Batch,
        write_end: float,
    ) -> None:
        # py-amqp's own frame writer, into a buffer: the group goes out in a few large writes
        # instead of one system call per message, and the bytes are exactly py-amqp's. Each
        # message is built just before it is written, so the broker works on the first
        # writes while the relay builds the rest.
        frames = session.frames
        frames.clear()
        write = session.writer
        channel_id = session.channel.channel_id
        publish_args = session.publish_args
        pending = 0  # messages in the buffer, not on the wire yet
        for index in group:
            if batch.sent and time.monotonic() > write_end:
                break  # the rest stays unsent (SKIPPED): its confirms could not come in time
            try:
                exchange, routing_key, message = self._build(session, messages[index])
            except self.general.outage_errors:
                raise
            except Exception as exc:
                batch.refused[index] = Attempt(Result.FAILED, error_text(exc))
                continue
            args = publish_args.get((exchange, routing_key))
            if args is None:
                args = amqp_dumps(_PUBLISH_ARGS, (0, exchange, routing_key, True, False))
                publish_args[(exchange, routing_key)] = args
            try:
                write(1, channel_id, amqp_spec.Basic.Publish, args, message)
            except Exception as exc:  # a header AMQP cannot encode (an integer over 64 bits)
                batch.refused[index] = Attempt(Result.FAILED, error_text(exc))
                continue
            batch.add((index, exchange, routing_key, message))
            pending += 1
            if frames.size >= _FLUSH_BYTES:
                self._flush(session, pending, write_end)
                pending = 0
        if pending and time.monotonic() > write_end:
            # Too late to start another write: these stay unsent, their tags unused.
            batch.withdraw(pending)
            frames.clear()
        elif pending:
            self._flush(session, pending, write_end)

    def _flush(self, session: _Session, count: int, write_end: float) -> None:
        data = session.frames.take()
        # Their tags are counted before the write: if it breaks part-way, these may have
        # reached the broker (the ledger holds them unsettled from when they were framed).
        session.next_tag += count
        write_before(session.raw.transport.sock, data, write_end)

    def _await(self, session: _Session, batch: _Batch, end: float) -> None:
        while batch.open:
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            try:
                session.raw.drain_events(timeout=remaining)
            except TimeoutError:
                break
        if batch.open:
            self._timed_out(session, batch)

    def _timed_out(self, session: _Session, batch: _Batch) -> None:
        why = f"no publisher confirm within {self.general.step:g} s"
        if session.blocked is not None:
            # Keep the connection: RabbitMQ stores what it already has once the alarm
            # clears, and check() refuses to claim until then, so nothing more is written.
            why += f" (RabbitMQ blocks publishing: {session.blocked})"
        else:
            self.abandon()  # frozen or too slow: reconnect (before the next claim)
        batch.close_open(Attempt(Result.OUTAGE, why))

    def _connection_lost(self, session: _Session, exc: BaseException) -> None:
        # Every group in flight on it shares the loss: any of their unsettled messages may
        # have caused a break, so all of them become suspects together.
        self.abandon()
        lost = _close_all(session, Attempt(Result.OUTAGE, error_text(exc)))
        ids = [batch.messages[batch.sent[pos][0]].row.id for batch, pos in lost]
        if ids and is_break(exc) and self.isolation.broke(ids):
            batch, pos = lost[0]
            batch.results[pos] = Attempt(Result.FAILED, culprit_error(exc))

    def _channel_lost(self, session: _Session, exc: BaseException) -> None:
        # The broker closed the confirm channel for something one message did (an exchange
        # deleted since it was checked, a message over its size limit): the rest of every
        # group on that channel was discarded. Nothing is an outage; the unsettled messages
        # are released, and become suspects so a culprit that keeps doing it is found.
        session.exchanges = {""}
        try:
            session.channel.confirm_select()  # py-amqp reopened it, out of confirm mode
            session.next_tag = 1
        except Exception:
            self.abandon()
        lost = _close_all(session, Attempt(Result.SKIPPED))
        ids = [batch.messages[batch.sent[pos][0]].row.id for batch, pos in lost]
        if ids and self.isolation.broke(ids):
            batch, pos = lost[0]
            batch.results[pos] = Attempt(Result.FAILED, culprit_error(exc))

    def _confirm_channel(self, raw: Any) -> Any:
        channel = raw.channel()
        channel.confirm_select()
        channel.events["basic_ack"].add(lambda tag, multiple: self._settle(tag, multiple, False))
        channel.events["basic_nack"].add(lambda tag, multiple: self._settle(tag, multiple, True))
        channel.events["basic_return"].add(self._returned)
        return channel


def _close_all(session: _Session, attempt: Attempt) -> list[tuple[_Batch, int]]:
    """Give the unsettled messages of every group in flight this attempt; list them."""
    return [(batch, pos) for batch in session.batches for pos in batch.close_open(attempt)]


def write_before(sock: socket.socket, data: bytes, end: float) -> None:
    """Write all of `data` before `end` (monotonic seconds), or raise TimeoutError.

    py-amqp's write timeout bounds each system call: a broker that takes a few bytes at a time
    (a slow link, a nearly full buffer) would keep one write going for as long as it keeps
    taking them, and the claim waiting on it could outlive --stale-timeout. The deadline here
    holds for the whole write. A write cut short leaves a partial frame: the caller treats it
    as a lost connection (an outage), which it is.
    """
    view = memoryview(data)
    previous = sock.gettimeout()
    try:
        while view:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the broker took {len(data) - len(view)} of {len(data)} bytes in time"
                )
            sock.settimeout(remaining)
            view = view[sock.send(view) :]
    finally:
        sock.settimeout(previous)


def _forget(session: _Session, batch: _Batch) -> None:
    with contextlib.suppress(ValueError):
        session.batches.remove(batch)


class _UnconfirmedGroup:
    """A group written on the confirm channel; wait() awaits its confirms (a Pending)."""

    def __init__(
        self,
        *,
        owner: AmqpConfirmPublisher,
        session: _Session,
        messages: Sequence[OutgoingMessage],
        batch: _Batch,
        attempts: list[Attempt],
    ) -> None:
        self.owner = owner
        self.session = session
        self.messages = messages
        self.batch = batch
        self.attempts = attempts
        self.done = False

    def wait(self) -> list[Attempt]:
        if not self.done:
            self.done = True
            self.owner._finish_group(self.session, self.messages, self.batch, self.attempts)
        return self.attempts

    def cancel(self) -> None:
        self.done = True
        _forget(self.session, self.batch)
