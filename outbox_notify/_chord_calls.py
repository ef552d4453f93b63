"""A chord's result-backend calls, moved from the enqueue to the relay.

When a chord is applied, Celery tells the result backend about it before it sends the
header's tasks: `set_chord_size(group_id, size)` (Redis: two commands), and `apply_chord(...)`
(Redis: saves a header made of groups; key-value backends with INCR: saves the group). That
is the network, inside the caller's transaction, and it outlives a rollback.

OutboxCelery's backend records those calls instead of making them (`defer`), and the chord's
header rows carry them in their options (`backend_calls`, schema version 2, which relays
older than this layout leave alone). The relay makes each call before it publishes the rows
that carry it (relay/chords.py), once per chord and relay process, and again after a restart
(both calls only set the same keys again).

The header rows are every row its group's fan-out wrote (batching.for_group): the header's
own tasks, and the first task of each chain, group or chord in it, whose later tasks only a
worker sends, once that first one has run. So no task that can complete a part of the chord
runs before the relay has made its calls. A chord's header is the fan-out in which Celery set
its size (`set_chord_size`, called for every chord, also where it does nothing); a fan-out
nested in another one (a chord inside a chord's header) also carries the outer one's calls.

Which calls move: `set_chord_size` wherever a backend implements it (Celery's Redis backend;
Celery's base class does nothing), and `apply_chord` of the Redis backends and of the key-value
backends whose chords count with INCR (cache/memcached, DynamoDB, GCS...), whose writes are
plain SETs. Any other `apply_chord` stays at the call: Celery's own fallback only sends the
`chord_unlock` task, which goes into the outbox like any other, and a backend of unknown
semantics (django-celery-results writes a `ChordCounter` row through the ORM, in the caller's
transaction when it shares the outbox's database, and not idempotently) is not replayed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from celery.backends.base import Backend, BaseKeyValueStoreBackend
from celery.result import result_from_tuple
from celery.utils.functional import regen

from outbox_notify import serialization

SET_CHORD_SIZE = "set_chord_size"
APPLY_CHORD = "apply_chord"
ORIGINALS = "_outbox_notify_originals"

# Calls recorded while a chord is being applied, by group id, until its header rows exist.
_recorded: contextvars.ContextVar[dict[str, list[dict[str, Any]]] | None] = contextvars.ContextVar(
    "outbox_notify_chord_calls", default=None
)


def wrap(backend: Any, recording: Callable[[], bool]) -> None:
    """Make `backend` record its chord calls while `recording()` says a chord is enqueued."""
    originals = {SET_CHORD_SIZE: backend.set_chord_size, APPLY_CHORD: backend.apply_chord}
    setattr(backend, ORIGINALS, originals)
    set_chord_size = originals[SET_CHORD_SIZE]
    apply_chord = originals[APPLY_CHORD]
    replayable = _replayable_apply_chord(backend, apply_chord)
    sizes = getattr(set_chord_size, "__func__", None) is not Backend.set_chord_size

    def deferred_set_chord_size(group_id: str, chord_size: int) -> Any:
        fan_out = _fan_out.get()
        if fan_out is None or not recording():
            return set_chord_size(group_id, chord_size)
        fan_out.headers.append(group_id)  # this fan-out is the chord's header
        if not sizes:
            return set_chord_size(group_id, chord_size)  # Celery's own does nothing
        _record(group_id, SET_CHORD_SIZE, [group_id, chord_size], {})
        return None

    def deferred_apply_chord(header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        # apply_chord runs before the header's fan-out starts, so no collector is active yet:
        # any chord applied through an OutboxCelery app's backend is one being enqueued (the
        # relay calls the original methods, kept in ORIGINALS).
        if not replayable or backend.app.conf.task_always_eager:
            return apply_chord(header_result_args, body, **kwargs)
        backend.ensure_chords_allowed()  # a backend without chords still refuses at the call
        group_id, results = header_result_args[0], header_result_args[1]
        args = [
            group_id,
            [r.as_tuple() for r in results],
            dict(body),
            type(results).__name__ == "_regen",  # celery.utils.functional.regen(): lazy
        ]
        _record(group_id, APPLY_CHORD, args, kwargs)
        return None

    backend.set_chord_size = deferred_set_chord_size
    backend.apply_chord = deferred_apply_chord


def _replayable_apply_chord(backend: Any, apply_chord: Any) -> bool:
    """Whether `apply_chord` only SETs keys (Redis, INCR key-value stores): safe to replay."""
    if (
        isinstance(backend, BaseKeyValueStoreBackend)
        and backend.implements_incr
        and getattr(apply_chord, "__name__", "") == "_apply_chord_incr"
    ):
        return True
    redis_backend = _redis_backend_class()
    return redis_backend is not None and isinstance(backend, redis_backend)


def _redis_backend_class() -> Any:
    try:
        from celery.backends.redis import RedisBackend
    except ImportError:  # pragma: no cover - celery always ships it; redis-py may be absent
        return None
    return RedisBackend


def _record(group_id: str, call: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    recorded = _recorded.get()
    if recorded is None:
        recorded = {}
        _recorded.set(recorded)
    entry = {"call": call, "args": args, "kwargs": kwargs, "id": serialization.new_id()}
    # Encoded now: a body that cannot be stored fails at the call, like any task argument.
    serialization.dumps(entry, "the chord's result-backend call")
    recorded.setdefault(group_id, []).append(entry)


@dataclasses.dataclass(kw_only=True)
class FanOut:
    """One group's fan-out while it is collected: the chords whose header it is."""

    headers: list[str] = dataclasses.field(default_factory=list)


_fan_out: contextvars.ContextVar[FanOut | None] = contextvars.ContextVar(
    "outbox_notify_fan_out", default=None
)


@contextlib.contextmanager
def fan_out() -> Iterator[FanOut]:
    """Mark a group's fan-out (batching.for_group) as the one running here, for its duration."""
    current = FanOut()
    token = _fan_out.set(current)
    try:
        yield current
    finally:
        _fan_out.reset(token)


def calls_of(current: FanOut) -> list[dict[str, Any]]:
    """Take the recorded calls of the chords whose header `current` was, for its rows."""
    recorded = _recorded.get()
    if not recorded:
        return []
    return [call for group_id in current.headers for call in recorded.pop(group_id, ())]


def discard() -> None:
    """Forget recorded calls: the fan-out that would carry them raised, or the outermost one
    ended (a call no fan-out took belongs to no row: a chord whose header failed to enqueue)."""
    _recorded.set(None)


_replaying: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "outbox_notify_chord_replay", default=False
)


def replaying() -> bool:
    """Whether the relay is making a recorded call (results it revives must not subscribe)."""
    return _replaying.get()


def apply(backend: Any, app: Any, call: dict[str, Any]) -> None:
    """Make one recorded call on the backend (the relay's), as Celery would have made it.

    The GroupResult that Celery builds from the header's results would subscribe to each
    of them (a result consumer in the relay, for results it never reads): OutboxCelery's
    backend skips that while `replaying()`.
    """
    token = _replaying.set(True)
    try:
        _apply(backend, app, call)
    finally:
        _replaying.reset(token)


def _apply(backend: Any, app: Any, call: dict[str, Any]) -> None:
    originals = getattr(backend, ORIGINALS, {})
    name = call["call"]
    method = originals.get(name) or getattr(backend, name)
    args = call["args"]
    if name == SET_CHORD_SIZE:
        method(str(args[0]), int(args[1]))
    elif name == APPLY_CHORD:
        group_id, tuples, body, lazy = args
        results = [result_from_tuple(t, app) for t in tuples]
        from celery import signature

        method(
            (group_id, regen(iter(results)) if lazy else results),
            signature(body, app=app),
            **call.get("kwargs", {}),
        )
    else:
        raise ValueError(f"unknown result-backend call {name!r}")
