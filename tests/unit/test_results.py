"""Deferred result subscriptions: kept in Celery's order, weakly, made once at a flush."""

from __future__ import annotations

import gc
from typing import Any

from outbox_notify._write.results import Deferred


class Result:
    """A stand-in for an AsyncResult: an id, nothing cached."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id
        self._cache = None


def deferred(made: list[tuple[str, bool]]) -> Deferred:
    """A Deferred whose subscriptions are recorded in `made` (a backend without catch-up)."""

    def subscribe(result: Any, weak: bool = False) -> Any:
        made.append((result.id, weak))
        return result

    return Deferred(object(), subscribe, collector=lambda: None)


def test_a_flush_makes_the_kept_subscriptions_in_order_once() -> None:
    """Subscriptions are made in the order Celery asked for them, with its weak flags, once."""
    made: list[tuple[str, bool]] = []
    kept = deferred(made)
    results = [Result("a"), Result("b"), Result("c")]
    kept.keep(results[0], weak=True)
    kept.keep(results[1], weak=False)
    kept.keep(results[0], weak=False)
    kept.keep(results[2], weak=True)
    assert made == []
    kept.flush()
    assert made == [("a", True), ("b", False), ("a", False), ("c", True)]
    kept.flush()
    assert len(made) == 4


def test_a_result_dropped_before_the_flush_is_not_subscribed() -> None:
    """Results are held weakly: one nobody holds any more is never subscribed."""
    made: list[tuple[str, bool]] = []
    kept = deferred(made)
    held = Result("held")
    kept.keep(Result("dropped"), weak=True)
    kept.keep(held, weak=True)
    gc.collect()
    kept.flush()
    assert made == [("held", True)]


def test_dead_entries_are_pruned_as_the_list_grows() -> None:
    """A process that never waits keeps a bounded list: dropped results' entries go."""
    kept = deferred([])
    kept.PRUNE_AT = 100
    kept.prune_at = 100
    alive = [Result(f"alive-{n}") for n in range(60)]
    for result in alive:
        kept.keep(result, weak=True)
    for n in range(1_000):
        kept.keep(Result(f"dropped-{n}"), weak=True)
    assert len(kept.kept) < 200
    assert sum(1 for ref, _ in kept.kept if ref() is not None) == 60
