"""pytest fixtures for projects that use outbox-notify (registered through `pytest11`).

- `outbox`: the outbox rows written during the test.
- `assert_task_sent(name, args=None, kwargs=None)`: assert one was, listing all if not.
- `fake_relay`: the real relay loop publishing into memory (`fake_relay.drain()`).
- `drain_outbox(run=False)`: publish everything due; with run=True also execute the tasks
  locally with Celery's `Task.apply`, so follow-ups they enqueue are drained too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


class OutboxRows:
    """The outbox rows written since the fixture was set up, oldest first."""

    def __init__(self, since_id: int) -> None:
        self.since_id = since_id

    def rows(self) -> list[Any]:
        """Fresh list of the rows (re-read each call)."""
        from outbox_notify import conf
        from outbox_notify.models import OutboxMessage

        return list(
            OutboxMessage.objects.using(conf.database_alias())
            .filter(id__gt=self.since_id)
            .order_by("id")
        )

    def __call__(self) -> list[Any]:
        return self.rows()

    def __iter__(self) -> Any:
        return iter(self.rows())

    def __len__(self) -> int:
        return len(self.rows())

    @property
    def task_names(self) -> list[str]:
        """Names of the queued tasks, in order."""
        return [row.task_name for row in self.rows()]


@pytest.fixture
def outbox(db: None) -> OutboxRows:
    """The outbox rows written during this test (iterable, len(), `.task_names`).

    Depends on pytest-django's `db`; with `transactional_db` in the test too, pytest-django
    makes the database transactional for both.
    """
    from django.db.models import Max

    from outbox_notify import conf
    from outbox_notify.models import OutboxMessage

    since = (
        OutboxMessage.objects.using(conf.database_alias()).aggregate(last=Max("id"))["last"] or 0
    )
    return OutboxRows(since)


def _describe(rows: list[Any]) -> str:
    if not rows:
        return "  (nothing was queued)"
    return "\n".join(f"  {row.task_name}(args={row.args!r}, kwargs={row.kwargs!r})" for row in rows)


@pytest.fixture
def assert_task_sent(outbox: OutboxRows) -> Callable[..., Any]:
    """Assert a task was queued during the test (args/kwargs checked only when given)."""

    def check(name: str, args: Any = None, kwargs: Any = None) -> Any:
        rows = outbox.rows()
        for row in rows:
            if row.task_name != name:
                continue
            if args is not None and list(row.args) != list(args):
                continue
            if kwargs is not None and dict(row.kwargs) != dict(kwargs):
                continue
            return row
        wanted = name + (f" args={list(args)!r}" if args is not None else "")
        wanted += f" kwargs={dict(kwargs)!r}" if kwargs is not None else ""
        raise AssertionError(
            f"no task {wanted} was queued in the outbox; queued:\n{_describe(rows)}"
        )

    return check


@pytest.fixture
def fake_relay(db: None) -> Any:
    """A relay publishing to memory through the real relay code; see `.drain()`, `.published`."""
    from outbox_notify.testing import FakeRelay

    return FakeRelay()


@pytest.fixture
def drain_outbox(fake_relay: Any) -> Callable[..., list[Any]]:
    """Publish everything due now; with run=True execute the tasks locally, until quiet."""

    def drain(run: bool = False, max_rounds: int = 100) -> list[Any]:
        published: list[Any] = []
        for _ in range(max_rounds):
            batch = fake_relay.drain()
            published.extend(batch)
            if not batch or not run:
                return published
            _run(batch)
        raise AssertionError(
            f"the outbox was still not quiet after {max_rounds} rounds of run=True"
        )

    return drain


def _run(messages: list[Any]) -> None:
    from outbox_notify import conf

    app = conf.celery_app()
    for message in messages:
        if message.event is not None:
            continue  # a domain event: its consumers live elsewhere, nothing runs here
        app.tasks[message.task_name].apply(
            args=message.args, kwargs=message.kwargs, task_id=message.task_id
        )
