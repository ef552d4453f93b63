"""Task protocol 1 is refused once, by a system check, with the same words as at the call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import transaction

from outbox_notify import OutboxCelery
from outbox_notify.app import check_task_protocol, instances
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.models import OutboxMessage

pytestmark = pytest.mark.django_db


@pytest.fixture
def legacy() -> Iterator[OutboxCelery]:
    """An OutboxCelery on task protocol 1, forgotten by the check after the test."""
    app = OutboxCelery("legacy-protocol", set_as_current=False)
    app.conf.update(broker_url="redis://127.0.0.1:1/0", task_protocol=1)
    yield app
    instances.discard(app)


def test_the_system_check_names_an_app_on_protocol_1(legacy: OutboxCelery) -> None:
    """check_task_protocol reports outbox_notify.E010 for an OutboxCelery on protocol 1."""
    errors = [e for e in check_task_protocol() if e.obj == "legacy-protocol"]
    assert [e.id for e in errors] == ["outbox_notify.E010"]
    assert "task_protocol=1" in errors[0].msg


def test_protocol_2_apps_pass_the_check() -> None:
    """The test suite's own app (protocol 2) is not reported."""
    assert [e for e in check_task_protocol() if e.obj == "tests"] == []


def test_a_protocol_1_call_is_a_configuration_error_and_writes_nothing(
    legacy: OutboxCelery,
) -> None:
    """An enqueue on protocol 1 raises ConfigurationError, not the caller's SerializationError."""
    with pytest.raises(ConfigurationError, match="task_protocol=1"), transaction.atomic():
        legacy.send_task("tests.add", (1, 2))
    assert OutboxMessage.objects.count() == 0
