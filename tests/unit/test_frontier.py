"""How one claim's report moves the relay's frontier (outbox_notify/relay/frontier.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from outbox_notify.relay.frontier import (
    DUE,
    LAST_ID,
    READY,
    RECHECK,
    START_TIME,
    WALK,
    Frontier,
    Seen,
    Taken,
)

AT = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


def _seen(limit: int = 10, picked: int = 0, **report: Any) -> Seen:
    fields: dict[str, Any] = {
        "at": AT,
        "xmax": 1000,
        "in_progress": frozenset(),
        "recheck_left": [],
        "late_left": [],
        "due_left": [],
        "walked_end": None,
        "walked": 0,
        "walked_left": [],
        "ready_left": [],
        **report,
    }
    return Seen(limit=limit, picked=picked, **fields)


def _ready(txid: int, id: int) -> Taken:
    return Taken(id=id, part=READY, txid=txid, retry_after=None)


def test_a_claim_that_did_not_fill_up_moves_ready_past_every_transaction_it_could_see() -> None:
    """Read to the end: the ready frontier passes the snapshot's xmax, so rows published by
    anyone (dead rows) are never read again; the rows others held are rechecked by id."""
    frontier = Frontier()
    asked = frontier.params()
    frontier.absorb(
        asked,
        [_ready(10, 1), _ready(12, 3)],
        _seen(picked=2, ready_left=[(11, 2), (13, 4)], xmax=20, in_progress=frozenset({14})),
    )
    assert frontier.ready == (19, LAST_ID)
    assert frontier.recheck == {2, 4}
    assert frontier.late == {14}  # its rows may still land behind the frontier
    assert frontier.scheduled == (19, LAST_ID)  # fewer than WALK new scheduled rows read


def test_a_full_claim_moves_ready_only_to_its_last_row_taken() -> None:
    """A claim cut by its limit has not read beyond its last row: the frontier stops there."""
    frontier = Frontier()
    asked = frontier.params()
    taken = [_ready(10, n) for n in range(1, 4)]
    frontier.absorb(asked, taken, _seen(limit=3, picked=3, ready_left=[]))
    assert frontier.ready == (10, 3)


def test_a_part_the_claim_never_reached_keeps_its_position() -> None:
    """Rows to recheck filled the claim: the due and ready positions stay where they were."""
    frontier = Frontier()
    frontier.ready = (50, 7)
    frontier.recheck = {1, 2, 3}
    asked = frontier.params()
    taken = [Taken(id=i, part=RECHECK, txid=5, retry_after=None) for i in (1, 2)]
    frontier.absorb(asked, taken, _seen(limit=2, picked=2, recheck_left=[3]))
    assert frontier.ready == (50, 7)
    assert frontier.due == (START_TIME, 0)
    assert frontier.recheck == {3}  # not read to its end: only what it took is gone


def test_running_transactions_behind_the_frontier_are_looked_up_once_they_end() -> None:
    """An in-progress xid older than the frontier is remembered, and forgotten once read after it ended."""
    frontier = Frontier()
    frontier.absorb(
        frontier.params(),
        [_ready(20, 5)],
        _seen(limit=1, picked=1, in_progress=frozenset({15, 25}), xmax=30, walked=WALK),
    )
    assert frontier.late == {15}  # 25 is ahead of the frontier: the forward read finds it
    still_running = _seen(picked=0, in_progress=frozenset({15}), xmax=31)
    frontier.absorb(frontier.params(), [], still_running)
    assert frontier.late == {15}
    ended = _seen(picked=0, in_progress=frozenset(), xmax=32, late_left=[9])
    frontier.absorb(frontier.params(), [], ended)
    assert frontier.late == set()
    assert frontier.recheck == {9}  # its row that someone else held


def test_an_ended_transaction_stays_while_the_claim_filled_up_before_reading_it() -> None:
    """The late part cut short by the limit: its transactions are read again next time."""
    frontier = Frontier()
    frontier.late = {15}
    frontier.recheck = {1}
    taken = [Taken(id=1, part=RECHECK, txid=3, retry_after=None)]
    frontier.absorb(frontier.params(), taken, _seen(limit=1, picked=1, xmax=40))
    assert frontier.late == {15}


def test_rows_released_while_a_claim_ran_are_not_lost_by_its_report() -> None:
    """A release between a claim's parameters and its report stays to be rechecked."""
    frontier = Frontier()
    asked = frontier.params()
    frontier.settle([], released=[42])
    frontier.absorb(asked, [], _seen(picked=0))
    assert frontier.recheck == {42}


def test_a_claim_that_read_every_due_row_moves_due_to_its_own_time() -> None:
    """Every row due at the claim's time was read; a clock that went back moves it back too."""
    frontier = Frontier()
    frontier.absorb(frontier.params(), [], _seen(picked=0))
    assert frontier.due == (AT, LAST_ID)
    earlier = AT - dt.timedelta(seconds=5)
    frontier.absorb(frontier.params(), [], _seen(picked=0, at=earlier))
    assert frontier.due == (earlier, LAST_ID)


def test_a_full_claim_moves_due_to_its_last_due_row() -> None:
    """Cut by its limit inside the due part: the due frontier stops at the last due row taken."""
    frontier = Frontier()
    at = AT - dt.timedelta(minutes=1)
    taken = [
        Taken(id=8, part=DUE, txid=3, retry_after=at),
        Taken(id=9, part=DUE, txid=3, retry_after=at),
    ]
    frontier.absorb(frontier.params(), taken, _seen(limit=2, picked=2, due_left=[4]))
    assert frontier.due == (at, 9)
    assert frontier.recheck == {4}
