"""A canvas's result subscriptions, moved from the enqueue to the first wait on a result.

While Celery sends a group it subscribes the result backend to each member's result: every
member's `AsyncResult.then(barrier)` calls `backend.add_pending_result`, which makes the
backend's result consumer (Redis pub/sub, RPC) listen for that task's result. A group's result
is ready only when that barrier is full, so `GroupResult.get()`/`join()` end only through
those subscriptions, and so does every result nested in it (a chain ending in a group inside
a group, a group's errback test...). Made at enqueue, they would be the network inside the
caller's transaction, a command per member, for results most callers never wait for, and
they would outlive a rollback.

Celery makes them in two places: a group's fan-out, for each member it sends, and every
GroupResult it builds, for the results the new barrier waits on (a chain or a chord freezing
a group it holds, outside any fan-out: `chain(a, group(b, c))`, a chord in a chord's header).
In both, OutboxCelery's backend keeps the subscriptions instead (`Deferred.keep`), holding
each result weakly, and makes them the next time a result of that backend is subscribed to
or waited on outside them: `AsyncResult.get()`, `AsyncResult.then()`, `GroupResult.get()`,
`join()` and `then()` all pass there. After subscribing, the kept results' states are read
once from the backend, so a task that finished while nobody listened (its result published
before the subscription) still resolves, from the stored result.
"""

from __future__ import annotations

import collections
import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import Any

import celery.result
from celery.backends.base import BaseKeyValueStoreBackend

# Set while a GroupResult is being built (its barrier subscribes to the results it waits on).
_building: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "outbox_notify_building_group_result", default=False
)


class GroupResult(celery.result.GroupResult):
    """Celery's GroupResult, whose subscriptions to its results wait for a wait (see above).

    OutboxCelery's `app.GroupResult`: the class Celery's canvas builds group results with.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        token = _building.set(True)
        try:
            super().__init__(*args, **kwargs)
        finally:
            _building.reset(token)

    def then(self, callback: Any, on_error: Any = None, weak: bool = False) -> Any:
        """Celery's then(), once the kept subscriptions are made (outside an enqueue)."""
        deferred = getattr(self.backend, "_outbox_notify_deferred", None)
        if isinstance(deferred, Deferred) and not deferred.enqueueing():
            deferred.flush()
        return super().then(callback, on_error, weak)


class Deferred:
    """The result subscriptions one backend kept during fan-outs, made at the next wait."""

    PRUNE_AT = 10_000  # kept entries before the dead ones (results dropped unawaited) go

    def __init__(
        self, backend: Any, subscribe: Callable[..., Any], collector: Callable[[], Any]
    ) -> None:
        self.backend = backend
        self.subscribe = subscribe  # the backend's own add_pending_result
        self.collector = collector
        # In Celery's order: (weak reference to the result, whether Celery asked for a weak
        # subscription). Replayed in that order, they subscribe exactly as Celery would have.
        # keep() only appends (atomic on a deque, so no lock per group member); taking
        # entries out (flush, prune) holds the lock, so a flush never misses one that a
        # prune is moving.
        self.kept: collections.deque[tuple[weakref.ref[Any], bool]] = collections.deque()
        self.lock = threading.Lock()
        self.prune_at = self.PRUNE_AT

    def enqueueing(self) -> bool:
        """Whether Celery is sending a group or building a group result here (keep, not make)."""
        return self.collector() is not None or _building.get()

    def keep(self, result: Any, weak: bool) -> Any:
        """Remember to subscribe `result` later (weakly held: a dropped result is never awaited)."""
        kept = self.kept
        kept.append((weakref.ref(result), weak))
        if len(kept) >= self.prune_at:
            self._prune()
        return result

    def _prune(self) -> None:
        with self.lock:
            kept = self.kept
            for _ in range(len(kept)):
                entry = kept.popleft()
                if entry[0]() is not None:
                    kept.append(entry)
            # Results still held (a long bulk block's): prune again only after as many more.
            self.prune_at = max(self.PRUNE_AT, 2 * len(kept))

    def flush(self) -> None:
        """Make every kept subscription whose result is still alive, then catch up on results."""
        if not self.kept:
            return
        results = []
        with self.lock:
            kept = self.kept
            while kept:
                ref, weak = kept.popleft()
                result = ref()
                if result is not None:
                    self.subscribe(result, weak=weak)
                    results.append(result)
            self.prune_at = self.PRUNE_AT
        self._catch_up(results)

    def _catch_up(self, results: list[Any]) -> None:
        """Hand the consumer the stored state of results that finished before they were followed.

        One read for all of them (an MGET on Redis). A result backend that queues results for
        its consumer (RPC) keeps them until they are read: nothing to catch up there.
        """
        consumer = getattr(self.backend, "result_consumer", None)
        if consumer is None or not isinstance(self.backend, BaseKeyValueStoreBackend):
            return
        # A result resolved while subscribing (from the consumer's buffer) needs nothing more.
        ids = list({result.id for result in results if not getattr(result, "_cache", None)})
        if not ids:
            return
        for _task_id, meta in self.backend.get_many(ids, interval=0, max_iterations=1):
            consumer.on_state_change(meta, None)


def defer(backend: Any, collector: Callable[[], Any], replaying: Callable[[], bool]) -> None:
    """Make `backend` keep its result subscriptions while `collector()` gives a collector (a
    group's rows are being collected) or a GroupResult is built, and drop them while
    `replaying()` (the relay makes a chord's backend calls: nothing there waits on a result)."""
    add_pending_result = getattr(backend, "add_pending_result", None)
    wait_for_pending = getattr(backend, "_wait_for_pending", None)
    if add_pending_result is None or wait_for_pending is None:
        return  # a backend that polls: nothing is subscribed, nothing to defer
    deferred = Deferred(backend, add_pending_result, collector)
    keep = deferred.keep  # once per group member: no lookups on the way

    def add_or_keep(result: Any, weak: bool = False, **kwargs: Any) -> Any:
        if collector() is not None:
            return keep(result, weak)
        if replaying():
            return result
        if _building.get():
            return keep(result, weak)
        deferred.flush()
        return add_pending_result(result, weak=weak, **kwargs)

    def flush_then_wait(result: Any, *args: Any, **kwargs: Any) -> Any:
        deferred.flush()
        return wait_for_pending(result, *args, **kwargs)

    backend.add_pending_result = add_or_keep
    backend._wait_for_pending = flush_then_wait
    backend._outbox_notify_deferred = deferred
