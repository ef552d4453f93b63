"""Places orders from a few threads at a steady rate, each in its own transaction.

Each order: create the Order, `fulfil_order.delay(...)` and `events.publish(OrderPlaced(...))`
(two rows in the outbox, in the same transaction), then commit, or roll back for the share of orders chosen to fail. The ledger
keeps the producer's side of the story: which orders committed (and when the commit
returned) and which rolled back.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time

PRODUCER_THREADS = 4
STOP = None  # sentinel that ends a producer thread


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ticket:
    """One order to place, and whether its transaction is to roll back."""

    number: int
    rollback: bool


@dataclasses.dataclass(kw_only=True)
class Ledger:
    """What the producers did; safe to update from several threads."""

    committed: dict[int, float] = dataclasses.field(default_factory=dict)  # id -> epoch s
    rolled_back: set[int] = dataclasses.field(default_factory=set)
    errors: list[str] = dataclasses.field(default_factory=list)
    executions_before: int = 0  # Execution ids up to this one belong to earlier runs
    receipts_before: int = 0  # EventReceipt ids likewise
    events: bool = True  # whether orders publish OrderPlaced (not on the filesystem transport)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record_commit(self, order_id: int, returned_at: float) -> None:
        """Note an order whose commit returned at `returned_at` (epoch seconds)."""
        with self.lock:
            self.committed[order_id] = returned_at

    def record_rollback(self, order_id: int) -> None:
        """Note an order whose transaction rolled back (its id is never reused)."""
        with self.lock:
            self.rolled_back.add(order_id)

    def record_error(self, text: str) -> None:
        """Note an order that failed unexpectedly."""
        with self.lock:
            self.errors.append(text)

    def committed_among(self, order_ids: set[int]) -> int:
        """How many of these orders are known to have committed."""
        with self.lock:
            return len(order_ids & self.committed.keys())

    def counts(self) -> tuple[int, int, int]:
        """(committed, rolled back, failed) so far."""
        with self.lock:
            return len(self.committed), len(self.rolled_back), len(self.errors)


def tickets(count: int, rollback_share: float, seed: int | None) -> list[Ticket]:
    """The orders to place, with the rolled-back ones chosen at random."""
    rng = random.Random(seed)
    return [Ticket(number=n, rollback=rng.random() < rollback_share) for n in range(count)]


def place_order(ticket: Ticket, ledger: Ledger) -> None:
    """Create one order and enqueue its fulfilment in one transaction; commit or roll back."""
    from django.conf import settings
    from django.db import transaction

    from example.shop import events as shop_events
    from example.shop.models import Order
    from example.shop.tasks import fulfil_order
    from outbox_notify import events

    with transaction.atomic():
        order = Order.objects.create(
            customer=f"customer-{ticket.number % 17}", amount_cents=100 + ticket.number
        )
        fulfil_order.delay(order.pk, time.time())
        if settings.SHOP_PUBLISH_EVENTS:  # a second outbox row, in the same transaction
            placed = shop_events.OrderPlaced(
                order_id=order.pk, customer=order.customer, amount_cents=order.amount_cents
            )
            events.publish(placed, exchange=shop_events.exchange())
        if ticket.rollback:
            transaction.set_rollback(True)
    if ticket.rollback:
        ledger.record_rollback(order.pk)
    else:
        ledger.record_commit(order.pk, time.time())


class Producer:
    """A pacing thread that hands out tickets at `rate` per second to a pool of threads."""

    def __init__(self, planned: list[Ticket], rate: float, ledger: Ledger) -> None:
        self.planned = planned
        self.rate = rate
        self.ledger = ledger
        self.stop = threading.Event()
        self.inbox: queue.Queue[Ticket | None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._work, name=f"producer-{n}", daemon=True)
            for n in range(PRODUCER_THREADS)
        ]
        self.pacer = threading.Thread(target=self._pace, name="pacer", daemon=True)

    def start(self) -> None:
        """Start placing orders in the background."""
        for thread in self.threads:
            thread.start()
        self.pacer.start()

    def done(self) -> bool:
        """True once every thread has finished."""
        return not self.pacer.is_alive() and not any(t.is_alive() for t in self.threads)

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop handing out tickets; wait a little for orders in flight to finish."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in (self.pacer, *self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def _pace(self) -> None:
        started = time.monotonic()
        try:
            for index, ticket in enumerate(self.planned):
                if self.stop.wait(max(0.0, started + index / self.rate - time.monotonic())):
                    return
                self.inbox.put(ticket)
        finally:
            for _ in self.threads:
                self.inbox.put(STOP)

    def _work(self) -> None:
        from django.db import connections

        try:
            while (ticket := self.inbox.get()) is not STOP and not self.stop.is_set():
                try:
                    place_order(ticket, self.ledger)
                except Exception as exc:
                    self.ledger.record_error(f"order {ticket.number}: {type(exc).__name__}: {exc}")
        finally:
            connections.close_all()
