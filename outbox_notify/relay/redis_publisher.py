"""The Redis fast path: a whole batch in one pipelined round trip, envelopes built by kombu.

Celery over Redis publishes through kombu's Producer, which costs ~170 µs a message. For
messages routed the way Celery routes by default (the nameless exchange, the queue name as
routing key, JSON, no compression), this publisher asks kombu's own Redis channel to build
the very same envelope (prepare_message, then the in-place augmentation publish applies),
and sends all LPUSHes of the batch in one pipeline. Anything else (and anything on versions
relay/gates.py does not accept) goes through the KombuPublisher it wraps, so every message is
still exactly what Celery would have sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kombu.common import maybe_declare
from kombu.entity import maybe_delivery_mode
from kombu.utils.json import dumps

from outbox_notify.exceptions import BrokerUnavailable
from outbox_notify.relay import fastjson, gates
from outbox_notify.relay.messages import OutgoingMessage
from outbox_notify.relay.publisher import (
    Attempt,
    KombuPublisher,
    Result,
    broker_refuses_writes,
    culprit_error,
    error_text,
    is_break,
    may_start,
)

# Queue arguments that make kombu's Redis transport do more than one LPUSH per message.
_SPECIAL_QUEUE_ARGS = ("expires", "message_ttl", "max_length", "max_length_bytes")
_SPECIAL_X_ARGS = ("x-expires", "x-message-ttl", "x-max-length", "x-max-length-bytes")


def _special_queue(queue: dict[str, Any]) -> bool:
    arguments = queue.get("queue_arguments") or {}
    return any(queue.get(arg) for arg in _SPECIAL_QUEUE_ARGS) or any(
        arg in arguments for arg in _SPECIAL_X_ARGS
    )


def _eligible(message: OutgoingMessage, expiring: Any) -> bool:
    spec = message.spec
    if not isinstance(spec.exchange, str) or spec.exchange or not spec.routing_key:
        return False
    if spec.serializer != "json" or spec.compression:
        return False
    if expiring and spec.routing_key in expiring:
        return False  # kombu refreshes the queue's x-expires on every publish
    return not any(_special_queue(q) for q in spec.declare_json)


class RedisPipelinePublisher:
    """Publishes default-routed JSON messages with one Redis round trip per batch."""

    def __init__(self, fallback: KombuPublisher) -> None:
        self.fallback = fallback
        self.isolation = fallback.isolation
        self.declared: set[str] = set()
        self.declared_on: Any = None

    def check(self) -> None:
        """Raise BrokerUnavailable unless the broker can be reached now."""
        self.fallback.check()

    def close(self) -> None:
        """Drop the broker connection."""
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
        expiring = getattr(channel, "_expires", None)
        eligible = [_eligible(m, expiring) for m in messages]
        groups = self.isolation.plan(messages)
        if not all(eligible):
            self.fallback.report_fallback("messages kombu would route or encode otherwise")
            groups = [[i for i in g if eligible[i]] for g in groups]
        attempts = self._pipelined(producer, channel, messages, groups, deadline)
        slow = [i for i, ok in enumerate(eligible) if not ok]
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

    def _declare(self, channel: Any, message: OutgoingMessage) -> None:
        if channel is not self.declared_on:
            self.declared, self.declared_on = set(), channel
        for queue in message.spec.declare_json:
            if queue["name"] not in self.declared:
                for entity in message.spec.declare:
                    maybe_declare(entity, channel)
                    self.declared.add(entity.name)

    def _envelope(
        self, producer: Any, channel: Any, message: OutgoingMessage
    ) -> tuple[str, str | bytes]:
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
        channel._inplace_augment_message(envelope, "", spec.routing_key)
        key = channel._q_for_pri(
            spec.routing_key, channel._get_message_priority(envelope, reverse=False)
        )
        return key, (fastjson.dumps(envelope) if message.plain else dumps(envelope))

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
        keys: dict[int, str] = {}
        payloads: dict[str, list[str | bytes]] = {}
        for index in group:
            message = messages[index]
            try:
                self._declare(channel, message)
                key, payload = self._envelope(producer, channel, message)
            except self.fallback.outage_errors:
                raise
            except Exception as exc:
                attempts[index] = _error_attempt(exc)
                continue
            payloads.setdefault(key, []).append(payload)
            keys[index] = key
        replies = self._send(channel, payloads)
        for index, key in keys.items():
            attempts[index] = replies[key]
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


def _error_attempt(exc: BaseException) -> Attempt:
    # Out of memory, read-only replica...: Redis refuses everyone, so no retry is spent.
    kind = Result.OUTAGE if broker_refuses_writes(exc) else Result.FAILED
    return Attempt(kind, error_text(exc))


def _reply_attempt(reply: Any) -> Attempt:
    if isinstance(reply, Exception):
        return _error_attempt(reply)
    return Attempt(Result.PUBLISHED)
