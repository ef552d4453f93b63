"""How confirms settle the RabbitMQ publisher's groups when two are in flight on one channel."""

from __future__ import annotations

from outbox_notify.relay.amqp_publisher import _Batch
from outbox_notify.relay.publisher import Attempt, Result


def batch(first_tag: int, size: int) -> _Batch:
    group = _Batch(
        first_tag=first_tag,
        sent=[(i, "", "q", object()) for i in range(size)],
        results=[None] * size,
    )
    group.open = size
    return group


def results(group: _Batch) -> list[Result | None]:
    return [r.result if r is not None else None for r in group.results]


def test_a_multiple_ack_beyond_a_group_settles_all_of_it_and_the_next_up_to_its_tag() -> None:
    """RabbitMQ may ack "everything up to tag 6" with one frame: tags 1-4 of the first group
    and 5-6 of the second."""
    first, second = batch(1, 4), batch(5, 4)
    for group in (first, second):
        group.settle(6, multiple=True, nacked=False)
    assert results(first) == [Result.PUBLISHED] * 4
    assert first.open == 0
    assert results(second) == [Result.PUBLISHED, Result.PUBLISHED, None, None]
    assert second.open == 2


def test_a_single_confirm_settles_only_its_own_group() -> None:
    """A tag of another group is ignored, before or after this group's range."""
    first, second = batch(1, 2), batch(3, 2)
    for group in (first, second):
        group.settle(3, multiple=False, nacked=True)
        group.settle(2, multiple=False, nacked=False)
    assert results(first) == [None, Result.PUBLISHED]
    assert results(second) == [Result.OUTAGE, None]


def test_closing_the_open_positions_gives_them_one_attempt() -> None:
    """What a lost connection or channel does to a group's unsettled messages."""
    group = batch(1, 3)
    group.settle(1, multiple=False, nacked=False)
    lost = Attempt(Result.OUTAGE, "gone")
    assert group.close_open(lost) == [1, 2]
    assert group.results[1:] == [lost, lost]
    assert group.open == 0
