"""Live progress while the demo runs, and the summary that decides its exit status."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TextIO

from example.demokit.orders import Ledger

PLAIN_PROGRESS_EVERY = 2.0  # seconds between progress lines when stdout is not a terminal


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """Counts at one instant, for the progress line."""

    placed: int
    planned: int
    committed: int
    rolled_back: int
    executed: int
    events: int | None  # committed orders whose OrderPlaced was received; None: not published
    in_outbox: int
    elapsed: float

    @property
    def caught_up(self) -> bool:
        """Every committed order executed, and its event received (when events are on)."""
        received = self.committed if self.events is None else self.events
        return self.executed >= self.committed and received >= self.committed

    def line(self) -> str:
        """The one-line rendering."""
        events = "" if self.events is None else f"  events {self.events}"
        return (
            f"[{self.elapsed:6.1f}s] placed {self.placed}/{self.planned}  "
            f"committed {self.committed}  rolled back {self.rolled_back}  "
            f"executed {self.executed}{events}  in outbox {self.in_outbox}"
        )


def last_execution_id() -> int:
    """The newest Execution id before this run (a DATABASE_URL may hold earlier runs)."""
    from django.db.models import Max

    from example.shop.models import Execution

    return int(Execution.objects.aggregate(last=Max("id"))["last"] or 0)


def last_receipt_id() -> int:
    """The newest EventReceipt id before this run."""
    from django.db.models import Max

    from example.shop.models import EventReceipt

    return int(EventReceipt.objects.aggregate(last=Max("id"))["last"] or 0)


def _received(ledger: Ledger) -> int | None:
    from example.shop.models import EventReceipt

    if not ledger.events:
        return None
    orders = set(
        EventReceipt.objects.filter(id__gt=ledger.receipts_before)
        .values_list("order_id", flat=True)
        .distinct()
    )
    return ledger.committed_among(orders)


def progress(ledger: Ledger, planned: int, started: float) -> Progress:
    """Read the ledger and the database (distinct orders executed, rows still in the outbox)."""
    from example.shop.models import Execution
    from outbox_notify.models import OutboxMessage

    ran = set(
        Execution.objects.filter(id__gt=ledger.executions_before)
        .values_list("order_id", flat=True)
        .distinct()
    )
    executed = ledger.committed_among(ran)
    events = _received(ledger)
    committed, rolled_back, failed = ledger.counts()  # read second: never below `executed`
    return Progress(
        placed=committed + rolled_back + failed,
        planned=planned,
        committed=committed,
        rolled_back=rolled_back,
        executed=executed,
        events=events,
        in_outbox=OutboxMessage.objects.count(),
        elapsed=time.monotonic() - started,
    )


class ProgressLine:
    """One updating line on a terminal; a line every few seconds otherwise (logs, CI)."""

    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last_plain = 0.0
        self.width = 0
        self.text = ""

    def show(self, current: Progress, *, force: bool = False) -> None:
        """Redraw the line (terminal) or print it when due (otherwise)."""
        self.text = current.line()
        if self.tty:
            self.stream.write("\r" + self.text.ljust(self.width))
            self.width = len(self.text)
        elif force or time.monotonic() - self.last_plain >= PLAIN_PROGRESS_EVERY:
            self.stream.write("  " + self.text + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()

    def end(self) -> None:
        """Leave the line as it is and move to the next one."""
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    """The outcome of a run, from the ledger and the worker's Execution rows."""

    committed: int
    executed: int
    rolled_back: int
    executed_rolled_back: int
    executed_early: int
    duplicates: int
    failed_orders: int
    outbox_left: int
    latencies_ms: list[float]
    missing: list[int]
    events: EventSummary | None = None  # None: events were not published in this run

    @property
    def ok(self) -> bool:
        """The verdict: every committed order ran, after its commit; no rolled-back one ran;
        every committed order's event was received once, and no rolled-back order's."""
        return (
            self.executed == self.committed
            and self.executed_rolled_back == 0
            and self.executed_early == 0
            and self.failed_orders == 0
            and (self.events is None or self.events.ok(self.committed))
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventSummary:
    """What the shop's consumer received: EventReceipt rows of this run against the ledger."""

    received: int  # committed orders with a receipt
    rolled_back: int  # receipts of orders that never committed
    duplicates: int  # receipts beyond the first per order
    latencies_ms: list[float]

    def ok(self, committed: int) -> bool:
        """Once per committed order, never for a rolled-back one."""
        return self.received == committed and self.rolled_back == 0 and self.duplicates == 0


def _event_summary(ledger: Ledger, committed: dict[int, float]) -> EventSummary | None:
    from example.shop.models import EventReceipt

    if not ledger.events:
        return None
    rows = EventReceipt.objects.filter(id__gt=ledger.receipts_before).values_list(
        "order_id", "received_at_epoch", "order_missing"
    )
    first: dict[int, float] = {}
    missing_order: set[int] = set()
    total = 0
    for order_id, at, order_missing in rows:
        first[order_id] = min(at, first.get(order_id, at))
        total += 1
        if order_missing:
            missing_order.add(order_id)
    return EventSummary(
        received=len(committed.keys() & first.keys()),
        rolled_back=len((first.keys() - committed.keys()) | (missing_order - committed.keys())),
        duplicates=total - len(first),
        latencies_ms=sorted((first[i] - at) * 1000.0 for i, at in committed.items() if i in first),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Runs:
    """The worker's Execution rows of this run, folded per order."""

    first: dict[int, float]  # order id -> epoch seconds of its first run
    without_order: set[int]  # order ids a run found no Order for
    total: int


def _runs(since_id: int) -> _Runs:
    from example.shop.models import Execution

    rows = Execution.objects.filter(id__gt=since_id).values_list(
        "order_id", "executed_at", "order_missing"
    )
    first: dict[int, float] = {}
    without_order: set[int] = set()
    total = 0
    for order_id, executed_at, order_missing in rows:
        at = executed_at.timestamp()
        first[order_id] = min(at, first.get(order_id, at))
        if order_missing:
            without_order.add(order_id)
        total += 1
    return _Runs(first=first, without_order=without_order, total=total)


def summarise(ledger: Ledger) -> Summary:
    """Compare what the producers committed with what the worker executed."""
    from outbox_notify.models import OutboxMessage

    runs = _runs(ledger.executions_before)
    with ledger.lock:
        committed = dict(ledger.committed)
        rolled_back = set(ledger.rolled_back)
        failed = len(ledger.errors)
    # A run that found no order, for an order nobody reported committed, is a rolled-back one.
    ran_rolled_back = (runs.first.keys() & rolled_back) | (runs.without_order - committed.keys())
    return Summary(
        committed=len(committed),
        executed=len(committed.keys() & runs.first.keys()),
        rolled_back=len(rolled_back),
        executed_rolled_back=len(ran_rolled_back),
        executed_early=len(runs.without_order & committed.keys()),
        duplicates=runs.total - len(runs.first),
        failed_orders=failed,
        outbox_left=OutboxMessage.objects.count(),
        latencies_ms=sorted(
            (runs.first[i] - at) * 1000.0 for i, at in committed.items() if i in runs.first
        ),
        missing=sorted(committed.keys() - runs.first.keys()),
        events=_event_summary(ledger, committed),
    )


def percentile(sorted_values: list[float], share: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN when there are none)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(share * len(sorted_values)))
    return sorted_values[rank - 1]


def render(summary: Summary) -> str:
    """The summary table."""
    lat = summary.latencies_ms
    rows = [
        ("committed", str(summary.committed)),
        ("executed", str(summary.executed)),
        ("rolled back", str(summary.rolled_back)),
        ("executed-but-rolled-back", f"{summary.executed_rolled_back}  (must be 0)"),
        ("executed before its commit", f"{summary.executed_early}  (must be 0)"),
        ("duplicate executions", str(summary.duplicates)),
        ("outbox rows left", str(summary.outbox_left)),
        ("latency p50 (commit→execution)", _ms(percentile(lat, 0.50))),
        ("latency p99", _ms(percentile(lat, 0.99))),
        ("latency max", _ms(lat[-1] if lat else math.nan)),
    ]
    if summary.failed_orders:
        rows.insert(3, ("orders that failed to place", str(summary.failed_orders)))
    if summary.events is not None:
        events = summary.events
        rows += [
            ("OrderPlaced events received", f"{events.received}  (must equal committed)"),
            ("events of rolled-back orders", f"{events.rolled_back}  (must be 0)"),
            ("events handled twice", f"{events.duplicates}  (must be 0)"),
            ("event latency p50 (commit→handler)", _ms(percentile(events.latencies_ms, 0.50))),
        ]
    width = max(len(name) for name, _ in rows)
    lines = ["summary", "-" * (width + 14)]
    lines += [f"  {name.ljust(width)}  {value}" for name, value in rows]
    lines.append("-" * (width + 14))
    lines.append("result: OK" if summary.ok else "result: FAILED")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f} ms"
