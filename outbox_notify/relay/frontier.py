"""Where a relay's next claim starts: the frontier that keeps claims off the rows published.

A row the relay deletes stays in the table and in its indexes until no snapshot can see it
any more. While some transaction holds an old snapshot, a claim that read an index from its
start would step over every row published since; so claims read each index from a position
this object remembers instead, and the rows that can still appear behind those positions are
looked up directly:

- `ready`: (txid, id) of the last ready row (no retry_after) a claim passed.
- `due`: (retry_after, id) of the last scheduled row that had fallen due when a claim passed
  it, or the claim's own time once it read every due row.
- `scheduled`: (txid, id) of the last scheduled row a claim saw being written. A new one is
  claimed at once when it is already due; otherwise it waits ahead of `due`.
- `late`: transactions in progress at a claim's snapshot whose rows could land behind a
  frontier (their txid is older than it). Once one has ended, the next claim reads its rows
  by txid; then it is forgotten.
- `recheck`: rows a claim saw but could not take (another session held them, or the claim
  filled up first), or that this relay released without publishing. Claims read them by id
  until they are gone or taken.

Nothing else can put a claimable row behind a frontier: a transaction that starts after a
claim gets a larger txid than any that claim saw, and every UPDATE restamps the row's txid
(sql/install.sql). So each claim reads what it claims, plus the rows it could not take and
the transactions that were in flight, never the rows already published: its cost does not
grow with the dead rows in the table.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import structlog

log = structlog.get_logger("outbox_notify")

# A position before every row of an index: (txid, id) and (retry_after, id).
START_TXID = 0
START_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LAST_ID = 2**63 - 1  # with a claim's time as `due`: every row due at that time was read
WALK = 1_000  # newly scheduled rows a claim reads at most (each is read once)

# The parts of a claim, in the order claim_batch reads them (its `part` column).
RECHECK, LATE, DUE, FRESH, READY = range(5)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """What a claim reported about the table besides the rows it took (claim_batch's meta)."""

    limit: int
    picked: int  # rows the claim's parts returned, duplicates included
    at: dt.datetime  # the claim statement's time on the database's clock
    xmax: int  # the snapshot's xmax: every transaction below it had started
    in_progress: frozenset[int]  # the snapshot's running transactions
    recheck_left: Sequence[int]
    late_left: Sequence[int]
    due_left: Sequence[int]
    walked_end: tuple[int, int] | None
    walked: int  # newly scheduled rows the claim read (at most WALK)
    walked_left: Sequence[int]
    ready_left: Sequence[tuple[int, int]]  # (txid, id)

    @classmethod
    def from_json(cls, limit: int, meta: str | dict[str, Any]) -> Seen:
        """Parse the meta row of claim_batch."""
        data = json.loads(meta) if isinstance(meta, str) else meta
        end = data.get("walked_end")
        return cls(
            limit=limit,
            picked=int(data["n"]),
            at=dt.datetime.fromisoformat(data["at"]),
            xmax=int(data["xmax"]),
            in_progress=frozenset(int(x) for x in data.get("xip") or ()),
            recheck_left=[int(i) for i in data.get("recheck_left") or ()],
            late_left=[int(i) for i in data.get("late_left") or ()],
            due_left=[int(i) for i in data.get("due_left") or ()],
            walked_end=(int(end[0]), int(end[1])) if end else None,
            walked=int(data.get("walked_n") or 0),
            walked_left=[int(i) for i in data.get("walked_left") or ()],
            ready_left=[(int(x), int(i)) for x, i in data.get("ready_left") or ()],
        )


class Taken(NamedTuple):
    """One row a claim took: the part that found it and its position in that part's index.

    A NamedTuple rather than a frozen dataclass: one is built for every row claimed, and a
    tuple is built in a fraction of the time.
    """

    id: int
    part: int
    txid: int
    retry_after: dt.datetime | None


STATE_FORMAT = 1  # the layout of a saved frontier (outbox_notify_frontier_v1.state)


MAX_TXID = 2**64 - 1  # an xid8


def _txid(value: Any) -> int:
    """A transaction id as saved: its decimal digits (an xid8 does not fit JSON's numbers)."""
    if not (isinstance(value, str) and value.isascii() and value.isdigit()):
        raise ValueError(f"not a transaction id: {value!r}")
    txid = int(value)
    if txid > MAX_TXID:
        raise ValueError(f"past the largest transaction id: {value!r}")
    return txid


def _row_id(value: Any) -> int:
    """A row id as saved: an integer a bigint holds, as every claim sends it."""
    if type(value) is not int or not 0 <= value <= LAST_ID:
        raise ValueError(f"not a row id: {value!r}")
    return value


def _time(value: Any) -> dt.datetime:
    """A position in time as saved: ISO 8601 with its time zone, as the database compares it."""
    if not isinstance(value, str):
        raise TypeError(f"not a time: {value!r}")
    moment = dt.datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"a time without a time zone: {value!r}")
    return moment


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"not a list: {value!r}")
    return value


def _unreadable(state: Any, error: str) -> None:
    log.warning(
        "outbox.frontier_unreadable",
        error=error,
        state=str(state)[:200],
        hint="starting from the beginning of every index; the next save supersedes it",
    )


class Frontier:
    """One relay's claim positions, shared by its claim connections and its LISTEN side."""

    def __init__(self) -> None:
        self.ready: tuple[int, int] = (START_TXID, 0)
        self.due: tuple[dt.datetime, int] = (START_TIME, 0)
        self.scheduled: tuple[int, int] = (START_TXID, 0)
        self.late: set[int] = set()
        self.recheck: set[int] = set()
        # Rows of this relay's open claims: a relay that starts from a saved frontier must
        # look at them again, since this one may die before it ends its claims.
        self.held: set[int] = set()
        self.loaded = False  # a saved frontier was looked for (see load())
        # The cluster and timeline the transaction ids are of (cluster_identity in
        # sql/queries.sql); None until known, or where the server does not tell.
        self.cluster: str | None = None

    # -- saved for the relays that start later ------------------------------------------

    def state(self) -> dict[str, Any]:
        """The frontier as saved in outbox_notify_frontier_v1 (JSON)."""
        return {
            "format": STATE_FORMAT,
            "ready": [str(self.ready[0]), self.ready[1]],
            "due": [self.due[0].isoformat(), self.due[1]],
            "scheduled": [str(self.scheduled[0]), self.scheduled[1]],
            "late": sorted(str(x) for x in self.late),
            "recheck": sorted(self.recheck | self.held),
            "cluster": self.cluster,
        }

    def load(self, state: Any) -> None:
        """Start from a frontier another relay (or this one, before a restart) saved.

        Any saved frontier is a safe start: it was true when saved, and whatever happened
        since is ahead of it, among its transactions to look up, or among its rows to recheck
        (the saving relay's open claims included). None (nothing saved yet): start from the
        beginning of every index, which is always safe, only slower past dead rows. So is a
        saved frontier that cannot be read (another layout, edited by hand, damaged): it is
        logged (outbox.frontier_unreadable) rather than left to stop every relay at its start,
        or to fail every claim with a position the database refuses.
        """
        self.loaded = True
        if state is None:
            return
        if not isinstance(state, dict):
            _unreadable(state, "not a JSON object")
            return
        if state.get("format") != STATE_FORMAT:
            _unreadable(state, f"format {state.get('format')!r}, this release reads {STATE_FORMAT}")
            return
        try:
            ready = (_txid(state["ready"][0]), _row_id(state["ready"][1]))
            due = (_time(state["due"][0]), _row_id(state["due"][1]))
            scheduled = (_txid(state["scheduled"][0]), _row_id(state["scheduled"][1]))
            late = {_txid(x) for x in _list(state["late"])}
            recheck = {_row_id(i) for i in _list(state["recheck"])}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            _unreadable(state, f"{type(exc).__name__}: {exc}")
            return
        self.ready, self.due, self.scheduled = ready, due, scheduled
        self.late, self.recheck = late, recheck
        cluster = state.get("cluster")  # absent in a frontier saved by an older release
        self.cluster = cluster if isinstance(cluster, str) else None

    def check(self, xmax: int, now: float, cluster: str | None = None) -> None:
        """Start again from the beginning if the positions are not this database's.

        `xmax`: the database's next transaction id; `now`: its clock (epoch seconds);
        `cluster`: its system identifier and timeline (None where the server does not say).
        A frontier saved in another cluster (a pg_dump restored elsewhere, a move by logical
        replication), or on a timeline a failover or a point-in-time recovery left, counts
        transactions that are not this database's: every new row could be behind it, passed
        over for good. A txid ahead of xmax gives it away even where the cluster is unknown.
        Starting from the beginning is always safe. Logged as outbox.frontier_ahead.
        """
        ahead = []
        if cluster is not None and self.cluster is not None and cluster != self.cluster:
            ahead.append(f"saved on cluster/timeline {self.cluster}, this is {cluster}")
        # Saved by an older release, or where the server did not tell: its positions may be
        # of any cluster. Started again without a warning (at each start that loads one).
        unknown = cluster is not None and self.cluster is None
        ahead += [
            f"{name} transaction {txid}"
            for name, txid in (("ready", self.ready[0]), ("scheduled", self.scheduled[0]))
            if txid >= xmax
        ]
        ahead += [f"late transaction {txid}" for txid in sorted(self.late) if txid >= xmax]
        if self.due[0].timestamp() > now:
            # The database's clock went back (a step, a failover to a slower clock): read the
            # scheduled rows from the start once, as a claim read to its end would from `now`.
            self.due = (START_TIME, 0)
        if cluster is not None:
            self.cluster = cluster
        if ahead:
            log.warning(
                "outbox.frontier_ahead",
                ahead=", ".join(ahead[:3]),
                next_txid=xmax,
                hint="the database was restored or copied from another cluster, failed or "
                "switched over, recovered to a point in time, or upgraded with pg_upgrade; "
                "starting from the beginning of every index",
            )
        elif not unknown:
            return
        self.ready, self.due, self.scheduled = (START_TXID, 0), (START_TIME, 0), (START_TXID, 0)
        self.late = set()

    # -- what queries read ---------------------------------------------------------------

    def params(self, *, with_held: bool = False) -> dict[str, Any]:
        """The frontier as parameters of claim_batch, peek, await_wake_lock and the gauges.

        `with_held`: count this relay's open claims among the rows to recheck (the gauges
        count them; a claim must not look at its own relay's rows).
        """
        recheck = self.recheck | self.held if with_held else self.recheck
        return {
            "ready_txid": str(self.ready[0]),
            "ready_id": self.ready[1],
            "due_at": self.due[0],
            "due_id": self.due[1],
            "sched_txid": str(self.scheduled[0]),
            "sched_id": self.scheduled[1],
            "late": [str(x) for x in sorted(self.late)],
            "recheck": sorted(recheck),
            "walk": WALK,
        }

    # -- what claims tell it ---------------------------------------------------------------

    def absorb(self, asked: dict[str, Any], taken: Sequence[Taken], seen: Seen) -> None:
        """Move the positions past what one claim read (see the module docstring).

        `asked`: the params() the claim ran with (the frontier may have gained rows to
        recheck or transactions to look up since, which this claim did not read).
        """
        exhausted = seen.picked < seen.limit
        parts = {row.part for row in taken}
        taken_ids = {row.id for row in taken}

        def read_to_its_end(part: int) -> bool:
            # A part read to its end: a later part was reached, or the claim did not fill up.
            return exhausted or any(p > part for p in parts)

        if read_to_its_end(RECHECK):
            self.recheck.difference_update(asked["recheck"])
            self.recheck.update(seen.recheck_left)
        if read_to_its_end(LATE):
            probed = {int(x) for x in asked["late"]}
            self.late -= {x for x in probed if x not in seen.in_progress and x < seen.xmax}
            self.recheck.update(seen.late_left)
        self._absorb_due(taken, seen, exhausted)
        if seen.walked_end is not None:
            self.scheduled = max(self.scheduled, seen.walked_end)
        if seen.walked < WALK:
            # Every scheduled row written by a transaction below the snapshot's xmax was read:
            # the rest are dead or rolled back, or still being written (looked up below).
            self.scheduled = max(self.scheduled, (seen.xmax - 1, LAST_ID))
        self.recheck.update(seen.walked_left)
        self._absorb_ready(taken, seen, exhausted)
        # Never past the snapshot's own transactions: a row copied in from another cluster
        # (pg_restore keeps its txid) may carry a txid this database has not handed out yet.
        # Reading it means every row below xmax was read (the indexes are in txid order);
        # the new rows of this database's next transactions must stay ahead.
        below = (seen.xmax - 1, LAST_ID)
        self.ready, self.scheduled = min(self.ready, below), min(self.scheduled, below)
        self.recheck -= taken_ids
        # Transactions still running whose rows could land behind a frontier: look them up
        # by txid once they end.
        horizon = max(self.ready[0], self.scheduled[0])
        self.late.update(x for x in seen.in_progress if x <= horizon)

    def _absorb_due(self, taken: Sequence[Taken], seen: Seen, exhausted: bool) -> None:
        due = [(r.retry_after, r.id) for r in taken if r.part == DUE and r.retry_after]
        if exhausted:
            # Every row due at the claim's time was read. Set even when it is behind the old
            # position (the database's clock went back): reading again is safe, skipping is not.
            self.due = (seen.at, LAST_ID)
        elif due:
            self.due = max(due)
        else:
            return
        self.recheck.update(seen.due_left)

    def _absorb_ready(self, taken: Sequence[Taken], seen: Seen, exhausted: bool) -> None:
        ready = [(r.txid, r.id) for r in taken if r.part == READY]
        if exhausted:
            # Every ready row written by a transaction below the snapshot's xmax was read:
            # the rest are published (dead rows, which the next claim must not read again,
            # whoever deleted them), rolled back, or still being written (looked up by txid).
            self.ready = max(self.ready, *ready, *seen.ready_left, (seen.xmax - 1, LAST_ID))
        elif ready:
            self.ready = max(ready)
        else:
            return
        self.recheck.update(i for _, i in seen.ready_left)

    def hold(self, ids: Iterable[int]) -> None:
        """Rows a claim of this relay now holds (until settle())."""
        self.held.update(ids)

    def settle(self, ids: Iterable[int], *, released: Iterable[int] = ()) -> None:
        """A claim ended: its rows are no longer held; `released` ones, let go untouched,
        are claimed again by id."""
        self.held.difference_update(ids)
        self.recheck.update(released)
