"""Delivery-tag arithmetic of publisher confirms, against a reference model, without a broker.

A channel carries groups of consecutive delivery tags (two in flight in the relay, more here);
every confirm and every basic.return goes to all of them, as the RabbitMQ publisher does.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox_notify.relay._confirm_ledger import (
    Confirm,
    ConfirmLedger,
    return_to_first,
    settle_each,
)
from outbox_notify.relay.amqp_publisher import _Batch
from outbox_notify.relay.publisher import Attempt, Result

# Tiny examples, many of them: the unit tier stays fast on a 2-core CI machine.
FAST = settings(max_examples=150, deadline=None)

Outcome = tuple[Confirm | str, str | None]  # a confirm and its reason, or the caller's closure


@dataclasses.dataclass(eq=False)
class Ledger(ConfirmLedger[int, Outcome]):
    """Items are content keys (several messages may look alike to a basic.return)."""

    calls: int = 0

    def outcome(self, confirm: Confirm, reason: str | None) -> Outcome:
        self.calls += 1
        return (confirm, reason)


@dataclasses.dataclass(frozen=True)
class Ack:
    tag: int
    multiple: bool
    nacked: bool


@dataclasses.dataclass(frozen=True)
class Return:
    key: int


Event = Ack | Return


class Reference:
    """The protocol as a dictionary of tags: the simplest model the ledger must agree with."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = dict(enumerate(keys, start=1))
        self.state: dict[int, Outcome | None] = dict.fromkeys(self.keys)
        self.returned: dict[int, str] = {}

    def apply(self, event: Event) -> None:
        if isinstance(event, Return):
            open_tags = [t for t in sorted(self.keys) if self.state[t] is None]
            for tag in open_tags:
                if tag not in self.returned and self.keys[tag] == event.key:
                    self.returned[tag] = f"no route for {event.key}"
                    return
            return
        if event.multiple:
            targets = [t for t, s in self.state.items() if s is None and t <= event.tag]
        else:
            targets = [event.tag] if self.state.get(event.tag, "settled") is None else []
        for tag in targets:
            if event.nacked:
                self.state[tag] = (Confirm.NACKED, None)
            elif tag in self.returned:
                self.state[tag] = (Confirm.UNROUTABLE, self.returned[tag])
            else:
                self.state[tag] = (Confirm.ACKED, None)


def channel(sizes: list[int], keys: list[int]) -> list[Ledger]:
    """Groups written one after the other on one channel, tags from 1."""
    ledgers, tag = [], 1
    for size in sizes:
        ledger = Ledger(first_tag=tag)
        for _ in range(size):
            assert ledger.add(keys[tag - 1]) == tag
            tag += 1
        ledgers.append(ledger)
    return ledgers


def apply(ledgers: list[Ledger], event: Event) -> None:
    if isinstance(event, Ack):
        settle_each(ledgers, event.tag, event.multiple, event.nacked)
    else:
        return_to_first(ledgers, lambda key: key == event.key, f"no route for {event.key}")


def states(ledgers: list[Ledger]) -> dict[int, Outcome | None]:
    return {
        ledger.first_tag + pos: result
        for ledger in ledgers
        for pos, result in enumerate(ledger.results)
    }


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[int], list[int], list[Event]]:
    """Group sizes, each message's content key, and confirms/returns in any order, with tags
    outside the channel (0, past the last) and repeats."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    total = sum(sizes)
    keys = draw(st.lists(st.integers(0, 2), min_size=total, max_size=total))
    acks = st.builds(Ack, st.integers(0, total + 2), st.booleans(), st.booleans())
    returns = st.builds(Return, st.integers(0, 2))
    events = draw(st.lists(st.one_of(acks, returns), max_size=3 * total))
    return sizes, keys, events


@FAST
@given(scenarios())
def test_any_interleaving_of_confirms_and_returns_matches_the_reference_model(
    scenario: tuple[list[int], list[int], list[Event]],
) -> None:
    """After every ack, nack and return, each tag's outcome is the reference model's."""
    sizes, keys, events = scenario
    ledgers, model = channel(sizes, keys), Reference(keys)
    for event in events:
        apply(ledgers, event)
        model.apply(event)
        assert states(ledgers) == model.state
        for ledger in ledgers:
            assert ledger.open == len(ledger.outstanding())
            assert all(r is not None for r in ledger.results[: ledger.low])


@FAST
@given(scenarios())
def test_each_tag_settles_exactly_once_and_closing_settles_the_rest(
    scenario: tuple[list[int], list[int], list[Event]],
) -> None:
    """A settled tag never changes (duplicates and late confirms are ignored); closing gives
    the caller's outcome to exactly the tags still open."""
    sizes, keys, events = scenario
    ledgers = channel(sizes, keys)
    for event in events:
        before = states(ledgers)
        apply(ledgers, event)
        after = states(ledgers)
        assert all(after[tag] is result for tag, result in before.items() if result is not None)
    confirmed = sum(r is not None for r in states(ledgers).values())
    assert sum(ledger.calls for ledger in ledgers) == confirmed
    open_tags = [tag for ledger in ledgers for tag in ledger.outstanding()]
    closed = [
        ledger.first_tag + pos
        for ledger in ledgers
        for pos in ledger.close_open(("lost", "connection"))
    ]
    assert closed == open_tags
    assert all(result is not None for result in states(ledgers).values())
    assert all(ledger.open == 0 and not ledger.outstanding() for ledger in ledgers)
    settle_each(ledgers, sum(sizes), True, False)  # a confirm after the loss changes nothing
    assert sum(ledger.calls for ledger in ledgers) == confirmed


@FAST
@given(scenarios(), st.data())
def test_a_multiple_ack_of_n_settles_exactly_the_open_tags_up_to_n(
    scenario: tuple[list[int], list[int], list[Event]], data: st.DataObject
) -> None:
    """ack(N, multiple) settles every open tag <= N, in any group, and nothing else."""
    sizes, keys, events = scenario
    ledgers = channel(sizes, keys)
    for event in events:
        apply(ledgers, event)
    tag = data.draw(st.integers(0, sum(sizes) + 2))
    before = states(ledgers)
    settle_each(ledgers, tag, True, False)
    changed = {t for t, result in states(ledgers).items() if result is not before[t]}
    assert changed == {t for t, result in before.items() if result is None and t <= tag}


@FAST
@given(st.integers(1, 6), st.integers(1, 100), st.data())
def test_a_single_confirm_outside_the_group_is_ignored(
    size: int, first_tag: int, data: st.DataObject
) -> None:
    """A tag before or after the group's range belongs to another group (or none): no-op."""
    ledger = Ledger(first_tag=first_tag)
    for key in range(size):
        ledger.add(key)
    outside = data.draw(
        st.one_of(st.integers(0, first_tag - 1), st.integers(first_tag + size, first_tag + 50))
    )
    ledger.settle(outside, multiple=False, nacked=data.draw(st.booleans()))
    ledger.settle(min(outside, first_tag - 1), multiple=True, nacked=False)
    assert ledger.outstanding() == list(range(first_tag, first_tag + size))
    assert ledger.calls == 0


@FAST
@given(st.integers(1, 6), st.data())
def test_withdrawn_messages_leave_their_tags_unused(size: int, data: st.DataObject) -> None:
    """Messages framed but never written are forgotten; the tags of the rest are unchanged."""
    ledger = Ledger(first_tag=1)
    for key in range(size):
        ledger.add(key)
    dropped = data.draw(st.integers(0, size))
    ledger.withdraw(dropped)
    assert ledger.outstanding() == list(range(1, size - dropped + 1))
    ledger.settle(size + 5, multiple=True, nacked=False)
    assert ledger.open == 0
    assert ledger.calls == size - dropped


def test_a_return_then_its_ack_is_unroutable_but_a_nack_wins() -> None:
    """basic.return precedes the ack of the same message: the ack then means unroutable; a
    nack of a returned message is still a nack; a return nothing open matches is dropped."""
    ledger = Ledger(first_tag=7)
    for key in (1, 1, 2):
        ledger.add(key)
    assert ledger.mark_returned(lambda key: key == 1, "NO_ROUTE")  # the oldest look-alike
    assert ledger.mark_returned(lambda key: key == 1, "NO_ROUTE")  # then the next one
    assert not ledger.mark_returned(lambda key: key == 1, "NO_ROUTE")
    ledger.settle(7, multiple=False, nacked=False)
    ledger.settle(8, multiple=False, nacked=True)
    ledger.settle(9, multiple=False, nacked=False)
    assert ledger.results == [
        (Confirm.UNROUTABLE, "NO_ROUTE"),
        (Confirm.NACKED, None),
        (Confirm.ACKED, None),
    ]
    assert not ledger.mark_returned(lambda key: True, "late")


def test_the_publisher_turns_confirms_into_attempts() -> None:
    """ack: published; ack after a return: failed with the unroutable text; nack: an outage."""
    group = _Batch(first_tag=1)
    for index in range(3):
        group.add((index, "", "q", object()))
    assert group.mark_returned(lambda item: item[0] == 1, "unroutable: no queue")
    group.settle(1, multiple=False, nacked=False)
    group.settle(2, multiple=False, nacked=False)
    group.settle(3, multiple=False, nacked=True)
    assert [r.result if r else None for r in group.results] == [
        Result.PUBLISHED,
        Result.FAILED,
        Result.OUTAGE,
    ]
    assert group.results[1] == Attempt(Result.FAILED, "unroutable: no queue")
