"""A group's result resolves, though its enqueue subscribed to nothing on the result backend.

No worker here: the tests store the members' results in the Redis result backend themselves,
as a worker does (`mark_as_done` writes the result and publishes it), before or while the
caller waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain, group
from django.db import transaction

from outbox_notify import OutboxCelery
from tests.celery_app import add, app

pytestmark = [
    pytest.mark.django_db(transaction=True),
    # Celery's Redis backend stores a result with SETEX, which redis-py 6+ marks deprecated.
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]
# transaction=True: the results are waited on after the enqueue's commit, as callers do.

WAIT = 10.0  # seconds: generous, the results are already stored or arrive at once


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A Redis client on the result backend's database."""
    assert app.conf.result_backend == redis_url
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def subscribers(client: redis.Redis, results: list[Any]) -> int:
    """How many pub/sub subscriptions the results' channels have on the result backend."""
    channels = [app.backend.get_key_for_task(r.id) for r in results]
    return sum(count for _, count in client.pubsub_numsub(*channels))


def finish(results: list[Any], value: Any = None) -> None:
    """Store each result as a worker would (its own id as the value unless one is given)."""
    for result in results:
        app.backend.mark_as_done(result.id, result.id if value is None else value)


def test_a_groups_members_are_subscribed_at_the_first_wait_not_at_enqueue(
    client: redis.Redis,
) -> None:
    """Enqueueing a group subscribes to none of its members; get() after they finished
    returns their results (read once from the backend, their messages long gone)."""
    with transaction.atomic():
        result = group(add.s(n, n) for n in range(3)).apply_async()
    assert subscribers(client, result.results) == 0
    finish(result.results)
    assert result.get(timeout=WAIT) == [r.id for r in result.results]


def test_a_group_nested_in_a_groups_chain_resolves(client: redis.Redis) -> None:
    """group(a, b, chain(c, group(d, e))) gives [a, b, [d, e]]: the inner group's members,
    frozen with the chain and never sent at enqueue, resolve too."""
    with transaction.atomic():
        result = group(
            add.si(1, 1), add.si(2, 2), chain(add.si(5, 5), group(add.si(3, 3), add.si(4, 4)))
        ).apply_async()
    first, second, inner = result.results
    finish([first, second, *inner.results])
    assert result.get(timeout=WAIT) == [first.id, second.id, [r.id for r in inner.results]]


def test_a_group_of_a_chain_ending_in_a_group_resolves_as_results_arrive(
    client: redis.Redis,
) -> None:
    """group(a | group(b, c)) is the inner group's result (Celery's special case); results
    published once get() has subscribed reach it through that subscription."""
    with transaction.atomic():
        result = group(add.s(1, 2) | group(add.s(1), add.s(2))).apply_async()
    stop = threading.Event()

    def finish_once_subscribed() -> None:
        while not stop.is_set():
            if subscribers(client, result.results) == len(result.results):
                finish(result.results, 7)
                return
            stop.wait(0.05)

    worker = threading.Thread(target=finish_once_subscribed, daemon=True)
    worker.start()
    try:
        assert result.get(timeout=WAIT) == [7, 7]
    finally:
        stop.set()
        worker.join(timeout=WAIT)


def test_canvases_that_build_group_results_enqueue_with_the_result_backend_down() -> None:
    """A chain ending in a group, or a chord in a chord's header, builds a GroupResult at
    enqueue, outside any fan-out: its subscriptions are kept too, so the backend is not needed."""
    down = OutboxCelery("down-group-results", set_as_current=False)
    down.conf.update(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/0")

    @down.task(name="tests.down_echo", shared=False)
    def echo(*args: Any) -> Any:
        return args

    with transaction.atomic():
        chained = chain(echo.s(1), group(echo.s(), echo.s())).apply_async()
        nested = (group(echo.s(1), group(echo.s(2), echo.s(3))) | echo.s()).apply_async()
    assert len(chained.results) == 2
    assert nested.parent is not None


def test_a_chain_ending_in_a_group_resolves(client: redis.Redis) -> None:
    """chain(a, group(b, c)) is the group's result, built at enqueue without a subscription
    and resolved at the wait."""
    with transaction.atomic():
        result = chain(add.si(1, 1), group(add.si(2, 2), add.si(3, 3))).apply_async()
    assert subscribers(client, result.results) == 0
    finish(result.results)
    assert result.get(timeout=WAIT) == [r.id for r in result.results]


def test_group_result_then_subscribes_the_members(client: redis.Redis) -> None:
    """GroupResult.then(callback) makes the kept subscriptions, for a result drainer to fire
    the callback (eventlet and gevent run one by themselves)."""
    with transaction.atomic():
        result = group(add.s(n, n) for n in range(2)).apply_async()
    assert subscribers(client, result.results) == 0
    done: list[Any] = []
    result.then(done.append)
    assert subscribers(client, result.results) == len(result.results)
    finish(result.results)
    result.get(timeout=WAIT)
    assert done == [result]
