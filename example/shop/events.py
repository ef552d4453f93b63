"""The domain event the example shop publishes beside its task, and where it goes."""

from __future__ import annotations

import dataclasses

from django.conf import settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrderPlaced:
    """An order committed: published in the order's own transaction, forwarded by the relay."""

    event_type = "shop.OrderPlaced"

    order_id: int
    customer: str
    amount_cents: int


def exchange() -> str:
    """The topic exchange the shop's events go to (SHOP_EVENTS_EXCHANGE in the settings)."""
    name: str = settings.SHOP_EVENTS_EXCHANGE
    return name
