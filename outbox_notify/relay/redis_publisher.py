"""The Redis fast path: a whole batch in one pipelined round trip, envelopes built by kombu.

Celery over Redis publishes through kombu's Producer, a round trip a message (figures:
docs/benchmarks.md#ceiling-publishing-to-the-broker-without-a-database). For
messages routed the way Celery routes by default (the nameless exchange, the queue name as
routing key, JSON, no compression), this publisher asks kombu's own Redis channel to build
the very same envelope (prepare_message, then the in-place augmentation publish applies),
and sends all LPUSHes of the batch in one pipeline. Domain events (relay/messages.py, schema
version 3) to a direct or topic exchange take the same path: their queues are looked up with
kombu's own `_lookup` once per exchange and routing key in a batch (kombu looks them up for
every message, a round trip each), and the envelope goes to each queue as kombu's exchange
would put it there. Anything else (and anything on versions outbox_notify/_compat.py does not accept)
goes through the KombuPublisher it wraps, so every message is still exactly what Celery, or
kombu's Producer.publish, would have sent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from kombu.common import maybe_declare
from kombu.entity import maybe_delivery_mode
from kombu.utils.json import dumps

from outbox_notify import _compat as gates
from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay import fastjson
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    KombuPublisher,
    Result,
    broker_refuses_writes,
    culprit_error,
    entity_names,
    error_text,
    exchange_key,
    is_break,
    may_start,
    unroutable_error,
)

log = structlog.get_logger("outbox_notify")

# Queue arguments that make kombu's Redis transport do more than one LPUSH per message.
_SPECIAL_QUEUE_ARGS = ("expires", "message_ttl", "max_length", "max_length_bytes")
_SPECIAL_X_ARGS = ("x-expires", "x-message-ttl", "x-max-length", "x-max-length-bytes")


def _special_queue(queue: dict[str, Any]) -> bool:
    arguments = queue.get("queue_arguments") or {}
    return any(queue.get(arg) for arg in _SPECIAL_QUEUE_ARGS) or any(
        arg in arguments for arg in _SPECIAL_X_ARGS
    )


def _eligible(message: OutgoingMessage, expiring: Any, special: dict[int, bool]) -> bool:
    """`special`: _special_queue of each declaration seen in this batch, by identity (the
    rows of one queue share its declaration: queues.declaration caches it)."""
    spec = message.spec
    if not isinstance(spec.exchange, str) or spec.exchange or not spec.routing_key:
        return False
    if spec.serializer != "json" or spec.compression:
        return False
    if expiring and spec.routing_key in expiring:
        return False  # kombu refreshes the queue's x-expires on every publish
    for queue in spec.declare_json:
        found = special.get(id(queue))
        if found is None:
            found = special[id(queue)] = _special_queue(queue)
        if found:
            return False
    return True


# Exchange types whose kombu emulation LPUSHes to the bound queues (fanout is pub/sub).
_ROUTED_TYPES = ("direct", "topic")


def _routed(message: OutgoingMessage) -> bool:
    """A domain event to a direct or topic exchange: routed by kombu's bindings, then LPUSHed."""
    spec = message.spec
    exchange = spec.declare_exchange
    return (
        exchange is not None
        and exchange.type in _ROUTED_TYPES
        and spec.serializer == "json"
        and not spec.compression
    )


Routes = dict[tuple[str, str], list[str]]
# The version-4 UUID's variant digit (RFC 9562: binary 10xx) for each random hex digit.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}
_TAGS_PER_READ = 512


class DeliveryTags:
    """Delivery tags for kombu's Redis envelopes: random version-4 UUIDs, as kombu makes them
    (`kombu.utils.uuid`), from one os.urandom() call per 512 tags.

    kombu's channel makes each one with a uuid.uuid4() call of its own: several percent of
    the relay's CPU per message (docs/benchmarks.md, "Against a previous commit"). A tag only
    has to be unique: a Redis consumer keys its unacknowledged messages by it. A process
    forked with tags in hand draws new ones (the pid is checked), so parent and child never
    hand out the same. One object per publisher, which one thread uses at a time.
    """

    def __init__(self) -> None:
        self.pid = 0
        self.pool = ""
        self.at = 0

    def __call__(self) -> str:
        at = self.at
        if at >= len(self.pool) or self.pid != os.getpid():
            self.pool = os.urandom(16 * _TAGS_PER_READ).hex()
            self.pid = os.getpid()
            at = 0
        self.at = at + 32
        h = self.pool[at : at + 32]
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


class RedisPipelinePublisher:
    """Publishes default-routed JSON messages with one Redis round trip per batch."""

    def __init__(self, fallback: KombuPublisher) -> None:
        self.fallback = fallback
        self.isolation = fallback.isolation
        self.declared: set[str] = set()
        self.declared_on: Any = None
        self.to_general: list[int] = []  # routed messages kombu must send (expiring queues)
        self.warmed: Any = None  # the channel warm() readied
        self.tags = DeliveryTags()
        self.tagged: Any = None  # the channel whose delivery tags come from self.tags

    def check(self) -> None:
        """Raise BrokerUnavailable unless the broker can be reached now; a new channel is
        readied before the claim that uses it (see warm)."""
        self.fallback.check()
        producer = self.fallback.producer
        if producer is not None and producer.channel is not self.warmed:
            self.warm(producer.channel)

    def warm(self, channel: Any) -> None:
        """Ready a new channel for its first batch, outside any claim: read the gate (the
        installed releases, from the packages' metadata) and open a socket of the pool
        kombu declares queues through (`conn_or_acquire`'s; the pipelines' pool, `client`'s,
        has one since kombu pinged it when it made the channel). Left to the first publish,
        they made the first batch after a start or a reconnect several times as long as the
        next ones, with every row in it and behind it waiting: the slowest messages of a
        latency run were the first ones.

        Only an optimisation: an error other than an outage is logged and the channel counts
        as readied (the first publish opens the socket and meets the error, as before)."""
        self.warmed = channel
        gates.redis_problem(channel)
        acquire = getattr(channel, "conn_or_acquire", None)
        if acquire is None:
            return
        try:
            with acquire() as client:
                client.ping()
        except self.fallback.outage_errors as exc:
            self.warmed = None
            self.fallback.abandon()
            raise BrokerUnavailable(f"the broker connection broke: {exc}") from exc
        except Exception as exc:
            if broker_refuses_writes(exc):  # MISCONF and the like: Redis refuses everyone
                self.warmed = None
                raise BrokerUnavailable(f"the broker refuses writes: {error_text(exc)}") from exc
            log.info("outbox.broker_warm_up_failed", error=error_text(exc))

    def close(self) -> None:
        """Drop the broker connection."""
        self.warmed = None
        self.tagged = None
        self.fallback.close()

    def publish(
        self, messages: Sequence[OutgoingMessage], deadline: Callable[[], bool]
    ) -> list[Attempt]:
        """Fast path for the messages that qualify (when the gate allows); kombu for the rest."""
        try:
            producer = self.fallback.connect()
        except BrokerUnavailable as exc:
            return [Attempt(Result.OUTAGE, str(exc))] * len(messages)
        channel = producer.channel
        problem = gates.redis_problem(channel)
        if problem is not None:
            self.fallback.report_fallback(problem)
            return self.fallback.publish_each(producer, messages, range(len(messages)), deadline)
        if channel is not self.tagged:
            self._tag(channel)
        expiring = getattr(channel, "_expires", None)
        special: dict[int, bool] = {}
        eligible = [_eligible(m, expiring, special) or _routed(m) for m in messages]
        groups = self.isolation.plan(messages)
        if not all(eligible):
            self.fallback.report_fallback("messages kombu would route or encode otherwise")
            groups = [[i for i in g if eligible[i]] for g in groups]
        self.to_general = []
        attempts = self._pipelined(producer, channel, messages, groups, deadline)
        slow = sorted([i for i, ok in enumerate(eligible) if not ok] + self.to_general)
        if not slow:
            return attempts
        if self.fallback.producer is None:  # the pipeline lost the connection
            lost = next((a for a in attempts if a.result is Result.OUTAGE), None)
            for index in slow:
                attempts[index] = lost or Attempt(Result.SKIPPED)
            return attempts
        general = self.fallback.publish_each(producer, messages, slow, deadline)
        for index in slow:
            attempts[index] = general[index]
        return attempts

    def _tag(self, channel: Any) -> None:
        """Make the channel's envelopes take their delivery tags from self.tags: the
        augmentation that publish applies (`_inplace_augment_message`) asks the channel's
        `_next_delivery_tag` for one. Only this relay's own channel; a kombu without that
        method keeps making its own tags."""
        self.tagged = channel
        if callable(getattr(channel, "_next_delivery_tag", None)):
            channel._next_delivery_tag = self.tags

    def _declare(self, channel: Any, message: OutgoingMessage) -> None:
        if channel is not self.declared_on:
            self.declared, self.declared_on = set(), channel
        exchange = message.spec.declare_exchange
        if exchange is not None and exchange_key(exchange) not in self.declared:
            exchange.declare(channel=channel)
            self.declared.add(exchange_key(exchange))
        for queue in message.spec.declare_json:
            if queue["name"] not in self.declared:
                for entity in message.spec.declare:
                    maybe_declare(entity, channel)
                    self.declared.add(entity.name)

    def _queues(self, channel: Any, message: OutgoingMessage, routes: Routes) -> list[str]:
        """The lists kombu would LPUSH this message onto (looked up once per batch and key)."""
        exchange, routing_key = entity_names(message)
        if not exchange:
            return [routing_key]
        queues = routes.get((exchange, routing_key))
        if queues is None:
            found = channel._lookup(exchange, routing_key)
            queues = sorted(q for q in found if q and q != channel.deadletter_queue)
            routes[(exchange, routing_key)] = queues
        return queues

    def _envelope(
        self, producer: Any, channel: Any, message: OutgoingMessage, queues: list[str]
    ) -> tuple[list[str], str | bytes]:
        spec = message.spec
        properties = dict(spec.properties)
        priority = properties.pop("priority", 0)
        properties["delivery_mode"] = maybe_delivery_mode(
            spec.delivery_mode or producer.exchange.delivery_mode
        )
        if message.expiration is not None:
            properties["expiration"] = str(int(message.expiration * 1000))
        body = message.body.encode("utf-8")
        envelope = channel.prepare_message(
            body, priority, message.content_type, "utf-8", message.headers, properties
        )
        exchange, routing_key = entity_names(message)
        channel._inplace_augment_message(envelope, exchange, routing_key)
        level = channel._get_message_priority(envelope, reverse=False)
        keys = [channel._q_for_pri(queue, level) for queue in queues]
        return keys, (fastjson.dumps(envelope) if message.plain else dumps(envelope))

    def _pipelined(
        self,
        producer: Any,
        channel: Any,
        messages: Sequence[OutgoingMessage],
        groups: list[list[int]],
        deadline: Callable[[], bool],
    ) -> list[Attempt]:
        attempts = [Attempt(Result.SKIPPED)] * len(messages)
        for number, group in enumerate(groups):
            if not group:
                continue
            if not may_start(deadline, self.fallback.step):
                break
            try:
                self._send_group(producer, channel, messages, group, attempts)
            except self.fallback.outage_errors as exc:
                # The round trip failed: we cannot know which LPUSHes the server ran, so
                # every message of the group is retried later (a possible duplicate, never a
                # loss), and nothing later is sent: no reconnect inside a claim.
                self.fallback.abandon()
                self._lost(messages, group, groups[number + 1 :], exc, attempts)
                break
        return attempts

    def _send_group(
        self,
        producer: Any,
        channel: Any,
        messages: Sequence[OutgoingMessage],
        group: list[int],
        attempts: list[Attempt],
    ) -> None:
        # One LPUSH per queue key with all of its messages: the same order as one LPUSH
        # each, and a fraction of the client-side command packing.
        keys: dict[int, list[str]] = {}
        payloads: dict[str, list[str | bytes]] = {}
        routes: Routes = {}
        expiring = getattr(channel, "_expires", None) or {}
        for index in group:
            message = messages[index]
            try:
                self._declare(channel, message)
                queues = self._queues(channel, message, routes)
                if expiring and any(queue in expiring for queue in queues):
                    self.to_general.append(index)  # kombu refreshes x-expires per publish
                    continue
                if not queues:
                    attempts[index] = Attempt(
                        Result.FAILED, unroutable_error(*entity_names(message))
                    )
                    continue
                keys[index], payload = self._envelope(producer, channel, message, queues)
            except self.fallback.outage_errors:
                raise
            except Exception as exc:
                attempts[index] = _error_attempt(exc)
                continue
            for key in keys[index]:
                payloads.setdefault(key, []).append(payload)
        replies = self._send(channel, payloads)
        for index, message_keys in keys.items():
            if len(message_keys) == 1:  # most messages: one list
                attempts[index] = replies[message_keys[0]]
            else:
                attempts[index] = _combined([replies[key] for key in message_keys])
        if self.isolation.suspects:
            self.isolation.cleared([messages[i].row.id for i in keys])

    def _lost(
        self,
        messages: Sequence[OutgoingMessage],
        group: list[int],
        later: list[list[int]],
        exc: BaseException,
        attempts: list[Attempt],
    ) -> None:
        outage = Attempt(Result.OUTAGE, error_text(exc))
        sent = [i for i in group if attempts[i].result is Result.SKIPPED]
        for index in [*sent, *(i for g in later for i in g)]:
            attempts[index] = outage
        if sent and is_break(exc) and self.isolation.broke([messages[i].row.id for i in sent]):
            attempts[sent[0]] = Attempt(Result.FAILED, culprit_error(exc))

    def _send(self, channel: Any, payloads: dict[str, list[str | bytes]]) -> dict[str, Attempt]:
        if not payloads:
            return {}
        pipe = channel.client.pipeline(transaction=False)
        for key, values in payloads.items():
            pipe.lpush(key, *values)
        results = pipe.execute(raise_on_error=False)
        for reply in results:
            if isinstance(reply, Exception) and str(reply).startswith("Protocol error"):
                # Redis replies this and then closes the connection (a command beyond
                # proto-max-bulk-len, say): the send broke it, whatever else it says.
                raise ConnectionError(f"Redis closed the connection: {reply}")
        return {key: _reply_attempt(reply) for key, reply in zip(payloads, results, strict=True)}


def _combined(attempts: list[Attempt]) -> Attempt:
    """One message's attempt from the replies of each list it went to (the worst one)."""
    for result in (Result.OUTAGE, Result.FAILED):
        for attempt in attempts:
            if attempt.result is result:
                return attempt
    return attempts[0]


def _error_attempt(exc: BaseException) -> Attempt:
    # Out of memory, read-only replica...: Redis refuses everyone, so no retry is spent.
    kind = Result.OUTAGE if broker_refuses_writes(exc) else Result.FAILED
    return Attempt(kind, error_text(exc))


def _reply_attempt(reply: Any) -> Attempt:
    if isinstance(reply, Exception):
        return _error_attempt(reply)
    return Attempt(Result.PUBLISHED)
