"""OnceTask without a database: keys, scopes, how once_key is given, which tasks it covers."""

from __future__ import annotations

import enum
import subprocess
import sys
from typing import Any

import pytest

from outbox_notify import OnceTask, OutboxCelery
from outbox_notify.exceptions import OnceKeyError
from outbox_notify.inbox import MAX_KEY_LENGTH, OnceKey, checked_key


class Colour(enum.StrEnum):
    RED = "red-value"


@pytest.fixture
def app() -> OutboxCelery:
    """A throwaway app whose default task class is OnceTask."""
    return OutboxCelery("unit", task_cls=OnceTask, set_as_current=False)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (17, "must be a str, got int"),
        (b"order", "must be a str, got bytes"),
        (None, "must be a str, got NoneType"),
        ("", "1 to 255 characters, got 0"),
        ("x" * (MAX_KEY_LENGTH + 1), "1 to 255 characters, got 256"),
        ("a\x00b", "NUL"),
        ("\udc80", "not valid Unicode"),
    ],
)
def test_unfit_keys_are_refused_with_a_clear_error(value: object, message: str) -> None:
    """A key must be a str of 1-255 characters, storable by PostgreSQL."""
    with pytest.raises(OnceKeyError, match=message):
        checked_key(value, "the key")


def test_fit_keys_are_stored_as_plain_text() -> None:
    """A str subclass (a StrEnum) is stored as its text, never as psycopg's enum label."""
    assert checked_key("x" * MAX_KEY_LENGTH, "k") == "x" * MAX_KEY_LENGTH
    stored = checked_key(Colour.RED, "k")
    assert (stored, type(stored)) == ("red-value", str)
    assert checked_key("ünïcödé ✓", "k") == "ünïcödé ✓"


def test_the_default_key_is_the_task_id_scoped_by_task_name(app: OutboxCelery) -> None:
    """No once_key: the task id, in the task name's scope."""

    @app.task(name="unit.plain")
    def plain() -> None: ...

    assert plain.once_inbox_key((), {}, "id-1") == OnceKey(
        scope="unit.plain", key="id-1", derived=False
    )


def test_once_key_as_a_decorator_option_gets_the_arguments_only(app: OutboxCelery) -> None:
    """once_key=lambda ...: called with the task's args and kwargs, bound task or not."""

    @app.task(name="unit.bound", bind=True, once_key=lambda order, *, note="": f"o:{order}{note}")
    def bound(self: Any, order: int, *, note: str = "") -> None: ...

    key = bound.once_inbox_key((5,), {"note": "!"}, "id-1")
    assert key == OnceKey(scope="unit.bound", key="o:5!", derived=True)


def test_once_key_as_a_method_of_a_subclass_gets_self_first(app: OutboxCelery) -> None:
    """A OnceTask subclass defines once_key(self, ...) like any method; scope shared by name."""

    class OrderTask(OnceTask):
        once_scope = "orders"

        def once_key(self, order: int) -> str:
            return f"{self.name}:{order}"

    @app.task(name="unit.confirm", base=OrderTask)
    def confirm(order: int) -> None: ...

    key = confirm.once_inbox_key((5,), {}, "id-1")
    assert key == OnceKey(scope="orders", key="unit.confirm:5", derived=True)


def test_an_unfit_scope_or_task_id_is_refused(app: OutboxCelery) -> None:
    """The scope and a caller-chosen task id go through the same checks as keys."""

    @app.task(name="unit.scoped", once_scope="")
    def scoped() -> None: ...

    @app.task(name="unit.idkey")
    def idkey() -> None: ...

    with pytest.raises(OnceKeyError, match="the once scope"):
        scoped.once_inbox_key((), {}, "id-1")
    with pytest.raises(OnceKeyError, match="the task id"):
        idkey.once_inbox_key((), {}, "x" * 300)


def test_a_default_task_class_covers_user_tasks_only(app: OutboxCelery) -> None:
    """task_cls=OnceTask: user tasks are once tasks; Celery's, ours and once=False are not."""

    @app.task(name="unit.user")
    def user() -> None: ...

    @app.task(name="unit.opted_out", once=False)
    def opted_out() -> None: ...

    @app.task(name="outbox_notify.unit_maintenance")
    def maintenance() -> None: ...

    app.finalize()
    assert isinstance(user, OnceTask)
    assert user.once_applies()
    assert not opted_out.once_applies()
    assert not maintenance.once_applies()
    assert not app.tasks["celery.chord_unlock"].once_applies()


def test_once_task_imports_before_django_setup() -> None:
    """`from outbox_notify import OnceTask` in proj/celery.py runs before django.setup()."""
    code = (
        "import os; os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.settings'\n"
        "from outbox_notify import OnceTask, OutboxCelery\n"
        "app = OutboxCelery('proj', task_cls=OnceTask)\n"
        "import django.apps; assert not django.apps.apps.ready\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
