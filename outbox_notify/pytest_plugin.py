"""pytest fixtures for projects that use outbox-notify (registered through `pytest11`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def outbox(db: None) -> Callable[[], list[Any]]:
    """Return a callable listing the outbox rows visible to the test, oldest first."""
    from outbox_notify.models import OutboxMessage

    def rows() -> list[OutboxMessage]:
        return list(OutboxMessage.objects.order_by("id"))

    return rows
