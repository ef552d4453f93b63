"""Publisher-confirm bookkeeping for one group of messages on a confirm-mode channel.

Pure: no I/O, no broker library. The RabbitMQ publisher writes frames and waits; this module
decides what each delivery tag's confirm means. What the protocol says and what is done here:

- A channel in confirm mode numbers the messages published on it 1, 2, 3... (the delivery
  tags). A group written in one go holds consecutive tags from `first_tag`.
- `basic.ack` / `basic.nack` settle one tag, or with `multiple` every tag up to it. The broker
  never confirms a tag twice; if it did, the first confirm stands and the second is ignored.
  A tag outside the group (another group on the same channel, or one before a channel reset)
  is ignored by this group: several groups in flight each hear every confirm.
- `basic.return` (a `mandatory` message no queue took) carries no delivery tag and comes
  before the ack of the same message; it is matched by content to the oldest unsettled,
  not yet returned message that fits, and turns that message's later ack into UNROUTABLE.
  A nack wins over a return. A return nothing matches is dropped.
- Closing (no confirm in time, a lost channel or connection) gives every unsettled tag the
  caller's outcome at once; what that outcome is (an outage, a release) is the caller's.

Outcomes are the subclass's to choose (`outcome()`), so the publisher settles straight into
its own `Attempt`s and tests into plain values.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")  # what the caller keeps for each tag (the message and where it went)
R = TypeVar("R")  # what a settled tag becomes


class Confirm(enum.Enum):
    """What the broker said about one delivery tag."""

    ACKED = "acked"  # basic.ack: stored
    UNROUTABLE = "unroutable"  # basic.return, then basic.ack: no queue took it
    NACKED = "nacked"  # basic.nack: refused (a queue at its limit, a broker error)


@dataclasses.dataclass(eq=False)
class ConfirmLedger(abc.ABC, Generic[T, R]):
    """The delivery tags of one written group, from `first_tag` on, and what became of each.

    Position p (an index into `sent` and `results`) is delivery tag `first_tag + p`; a None
    result is a tag still awaiting its confirm.
    """

    first_tag: int
    sent: list[T] = dataclasses.field(default_factory=list)
    results: list[R | None] = dataclasses.field(default_factory=list)
    returned: dict[int, str] = dataclasses.field(default_factory=dict)  # position -> why
    low: int = 0  # first position not settled yet
    open: int = 0  # positions not settled yet

    @abc.abstractmethod
    def outcome(self, confirm: Confirm, reason: str | None) -> R:
        """The result a tag gets from its confirm (`reason`: why it was returned)."""

    def add(self, item: T) -> int:
        """Record the next message of the group as unsettled; its delivery tag."""
        self.sent.append(item)
        self.results.append(None)
        self.open += 1
        return self.first_tag + len(self.sent) - 1

    def withdraw(self, count: int) -> None:
        """Forget the last `count` messages: they never went out, their tags stay unused."""
        if count:
            del self.sent[-count:], self.results[-count:]
            self.open -= count

    def settle(self, tag: int, multiple: bool, nacked: bool) -> None:
        """Apply a basic.ack (or with `nacked` a basic.nack) of `tag`."""
        position = tag - self.first_tag
        if position < 0:
            return  # a tag of an earlier group: "up to it" holds nothing of this one
        if position >= len(self.sent):
            if not multiple:
                return  # a tag of a later group
            position = len(self.sent) - 1  # "all up to a later tag": all of this group
        for pos in range(self.low, position + 1) if multiple else (position,):
            if self.results[pos] is None:
                self.results[pos] = self._confirmed(pos, nacked)
                self.open -= 1
        while self.low < len(self.sent) and self.results[self.low] is not None:
            self.low += 1

    def _confirmed(self, position: int, nacked: bool) -> R:
        if nacked:
            return self.outcome(Confirm.NACKED, None)
        if position in self.returned:
            return self.outcome(Confirm.UNROUTABLE, self.returned[position])
        return self.outcome(Confirm.ACKED, None)

    def mark_returned(self, matches: Callable[[T], bool], reason: str) -> bool:
        """Mark the oldest unsettled, unreturned message `matches` accepts as returned
        (a basic.return has no tag); False if none does."""
        for pos in range(self.low, len(self.sent)):
            if self.results[pos] is not None or pos in self.returned:
                continue
            if matches(self.sent[pos]):
                self.returned[pos] = reason
                return True
        return False

    def close_open(self, outcome: R) -> list[int]:
        """Give every unsettled message `outcome`; return their positions."""
        positions = [pos for pos, r in enumerate(self.results) if r is None]
        for pos in positions:
            self.results[pos] = outcome
        self.open = 0
        self.low = len(self.sent)
        return positions

    def outstanding(self) -> list[int]:
        """The delivery tags still awaiting their confirm."""
        return [self.first_tag + pos for pos, r in enumerate(self.results) if r is None]


def settle_each(
    ledgers: Iterable[ConfirmLedger[T, R]], tag: int, multiple: bool, nacked: bool
) -> None:
    """Apply one confirm to every group in flight on the channel (each takes its own tags)."""
    for ledger in ledgers:
        ledger.settle(tag, multiple, nacked)


def return_to_first(
    ledgers: Iterable[ConfirmLedger[T, R]], matches: Callable[[T], bool], reason: str
) -> bool:
    """Mark one returned message in the oldest group holding a match; False if none does."""
    return any(ledger.mark_returned(matches, reason) for ledger in ledgers)
