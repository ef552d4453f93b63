"""Bad input at the edges: what the write side refuses, what the relay carries, what the checks
and the relay command say about bad settings and unreachable services."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from django.core import checks as django_checks
from django.db import DataError, transaction
from django.test import override_settings

from devtools.pgserver import free_port
from outbox_notify.exceptions import SerializationError
from outbox_notify.models import OutboxMessage
from tests.celery_app import add, app
from tests.relay_support import ROOT, RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay runs in another process and sees only committed rows, and the
# SerializationError tests are about the caller's real transaction staying usable.

FAST = ["--sweep-interval", "1", "--backoff-time", "0.2", "--max-backoff", "1"]
MEGABYTE = 1 << 20
LONG_NAME = "tests." + "n" * 994  # 1,000 characters
COMMAND_TIMEOUT = 60  # seconds for a relay that must give up at start


class Unserializable:
    """An object JSON has no representation for."""


# Values kombu's JSON encoder refuses (each must raise SerializationError at the call).
NOT_JSON: list[tuple[str, Any]] = [
    ("object", Unserializable()),
    ("set", {1, 2}),
    ("bytearray", bytearray(b"x")),
    ("tuple-key", {(1, 2): 3}),
    ("function", len),
]
# Values kombu encodes, but as text PostgreSQL's json type rejects: they fail at the INSERT.
NOT_STORABLE: list[tuple[str, Any]] = [
    ("nan", float("nan")),
    ("infinity", float("-inf")),
]


def _ready(relay: Any) -> None:
    wait_for(
        lambda: "outbox.database_connected" in relay.output(),
        what="relay start",
        context=relay.output,
    )


def _message(queue: RedisQueue, task_id: str) -> dict[str, Any]:
    wait_for(lambda: task_id in queue.task_ids(), what=f"message {task_id} in Redis")
    return next(m for m in queue.messages() if m["headers"]["id"] == task_id)


def _assert_rows_and_usable(value: Any, *, as_kwarg: bool) -> None:
    with transaction.atomic():
        add.delay(1, 1)
        with pytest.raises(SerializationError) as excinfo:
            if as_kwarg:
                add.apply_async((1,), {"y": value})
            else:
                add.delay(value, 1)
        assert isinstance(excinfo.value, TypeError)
        add.delay(2, 2)  # the caller's transaction is still usable
    assert [row.args for row in OutboxMessage.objects.order_by("id")] == [[1, 1], [2, 2]]


@pytest.mark.parametrize("as_kwarg", [False, True], ids=["arg", "kwarg"])
@pytest.mark.parametrize(("label", "value"), NOT_JSON, ids=[n for n, _ in NOT_JSON])
def test_non_json_argument_raises_at_the_call_and_the_transaction_goes_on(
    label: str, value: Any, as_kwarg: bool
) -> None:
    """A value JSON cannot hold raises SerializationError; the caller's transaction commits."""
    _assert_rows_and_usable(value, as_kwarg=as_kwarg)


@pytest.mark.parametrize(("label", "value"), NOT_STORABLE, ids=[n for n, _ in NOT_STORABLE])
def test_values_postgresql_json_rejects_raise_serialization_error(label: str, value: Any) -> None:
    """NaN and Infinity are not JSON either: SerializationError, and the transaction goes on."""
    _assert_rows_and_usable(value, as_kwarg=False)


def test_one_megabyte_argument_goes_through_a_relay_to_redis(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """A 1 MB string argument is stored, published whole, and its row deleted."""
    relay = start_relay(*FAST)
    _ready(relay)
    big = "€" + "x" * MEGABYTE
    with transaction.atomic():
        result = add.apply_async((big, 1), queue=redis_queue.name)
    message = _message(redis_queue, result.id)
    assert message["body"][0] == [big, 1]
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted")


def test_task_name_of_a_thousand_characters_is_published(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """A 1,000-character task name is stored and published unchanged."""
    relay = start_relay(*FAST)
    _ready(relay)
    assert len(LONG_NAME) == 1000
    with transaction.atomic():
        result = app.send_task(LONG_NAME, args=[1], queue=redis_queue.name)
    assert OutboxMessage.objects.get().task_name == LONG_NAME
    message = _message(redis_queue, result.id)
    assert message["headers"]["task"] == LONG_NAME


def test_nul_bytes_in_arguments_round_trip_to_the_broker(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """NUL bytes in args, kwargs values and kwargs keys reach the broker exactly."""
    relay = start_relay(*FAST)
    _ready(relay)
    with transaction.atomic():
        result = app.send_task(
            "tests.record",
            args=["a\x00b", ["\x00"]],
            kwargs={"k\x00ey": "v\x00", "nested": {"\x00": "\x00\x00"}},
            queue=redis_queue.name,
        )
    message = _message(redis_queue, result.id)
    args, kwargs, _embed = message["body"]
    assert args == ["a\x00b", ["\x00"]]
    assert kwargs == {"k\x00ey": "v\x00", "nested": {"\x00": "\x00\x00"}}


@pytest.mark.parametrize("where", ["task_id", "task_name"])
def test_nul_byte_in_a_task_id_or_name_is_refused_at_the_call(where: str) -> None:
    """A NUL in a task id or name (text columns) fails at the call; the txn goes on."""
    with transaction.atomic():
        add.delay(1, 1)
        # Today psycopg refuses the NUL client-side (django.db.DataError), before anything
        # reaches the server, so the transaction is not aborted; SerializationError would be
        # the library's own word for it.
        with pytest.raises((SerializationError, DataError)):
            if where == "task_id":
                add.apply_async((1, 2), task_id="bad\x00id")
            else:
                app.send_task("bad\x00name", args=[1])
        add.delay(2, 2)
    assert OutboxMessage.objects.count() == 2


# -- settings ---------------------------------------------------------------------------------

INVALID_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("OUTBOX_NOTIFY_DATABASE", {"OUTBOX_NOTIFY_DATABASE": "no-such-alias"}),
    ("OUTBOX_NOTIFY_DATABASE", {"OUTBOX_NOTIFY_DATABASE": 1}),
    ("OUTBOX_NOTIFY_CELERY_APP", {"OUTBOX_NOTIFY_CELERY_APP": 42}),
    ("OUTBOX_NOTIFY_CELERY_APP", {"OUTBOX_NOTIFY_CELERY_APP": "no.such.module.app"}),
    ("OUTBOX_NOTIFY_LISTEN_DSN", {"OUTBOX_NOTIFY_LISTEN_DSN": 5432}),
    ("OUTBOX_NOTIFY_EXCLUDE_TASKS", {"OUTBOX_NOTIFY_EXCLUDE_TASKS": "tests.add"}),
    ("OUTBOX_NOTIFY_EXCLUDE_TASKS", {"OUTBOX_NOTIFY_EXCLUDE_TASKS": ["tests.add", 3]}),
    ("OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS", {"OUTBOX_NOTIFY_STRUCTLOG_CONTEXT_KEYS": "request_id"}),
    ("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", {"OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS": -1}),
    ("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", {"OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS": "30"}),
    ("OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS", {"OUTBOX_NOTIFY_DEAD_LETTER_RETENTION_DAYS": True}),
    ("OUTBOX_NOTIFY_REDACT", {"OUTBOX_NOTIFY_REDACT": "no.such.redactor"}),
    ("OUTBOX_NOTIFY_REDACT", {"OUTBOX_NOTIFY_REDACT": "os.sep"}),
    ("OUTBOX_NOTIFY_REDACT", {"OUTBOX_NOTIFY_REDACT": 7}),
    ("OUTBOX_NOTIFY_STATSD_PORT", {"OUTBOX_NOTIFY_STATSD_HOST": "127.0.0.1", "OUTBOX_NOTIFY_STATSD_PORT": "eighty"}),
]  # fmt: skip


def _outbox_errors() -> list[django_checks.CheckMessage]:
    found = django_checks.run_checks()
    return [m for m in found if m.id and m.id.startswith("outbox_notify.") and m.is_serious()]


@pytest.mark.parametrize(
    ("setting", "overrides"),
    INVALID_SETTINGS,
    ids=[f"{name}={next(iter(o.values()))!r}"[:60] for name, o in INVALID_SETTINGS],
)
def test_invalid_setting_is_a_system_check_error_naming_it(
    setting: str, overrides: dict[str, Any]
) -> None:
    """Each invalid OUTBOX_NOTIFY_* value gives one check error that names the setting once."""
    with override_settings(**overrides):
        errors = _outbox_errors()
    assert [error.obj for error in errors] == [setting], [str(e) for e in errors]
    assert str(errors[0]).count(setting) == 1, str(errors[0])


def test_invalid_statsd_tags_name_the_tags_setting() -> None:
    """A non-iterable OUTBOX_NOTIFY_STATSD_TAGS is an error under STATSD_TAGS, not _PORT."""
    overrides = {"OUTBOX_NOTIFY_STATSD_HOST": "127.0.0.1", "OUTBOX_NOTIFY_STATSD_TAGS": 5}
    with override_settings(**overrides):
        errors = _outbox_errors()
    assert [error.obj for error in errors] == ["OUTBOX_NOTIFY_STATSD_TAGS"], [
        str(e) for e in errors
    ]


# -- unreachable services at relay start ------------------------------------------------------


def _relay_once(env: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", "outbox_listen", *FAST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def _assert_clear(result: subprocess.CompletedProcess[str], *words: str) -> list[str]:
    """Non-zero, no traceback, the first line says what is wrong; return the stderr lines."""
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert lines, output
    assert lines[0].startswith("CommandError: "), output
    assert all(word in lines[0] for word in words), output
    return lines


def test_unreachable_broker_at_start_exits_non_zero_with_one_line(
    relay_env: dict[str, Any],
) -> None:
    """A relay whose broker is down at start says so in one line, without a traceback."""
    env = {**relay_env, "OUTBOX_TEST_BROKER_URL": "redis://:secret-pw@127.0.0.1:1/0"}
    result = _relay_once(env)
    assert len(_assert_clear(result, "broker")) == 1
    assert "secret-pw" not in result.stdout + result.stderr


def _closed_database_env(relay_env: dict[str, Any]) -> dict[str, Any]:
    closed = f"postgresql://postgres:secret-pw@127.0.0.1:{free_port()}/postgres"
    return {**relay_env, "OUTBOX_TEST_DATABASE_URL": closed}


def test_unreachable_database_at_start_exits_non_zero_without_traceback(
    relay_env: dict[str, Any],
) -> None:
    """A relay whose database port is closed exits non-zero with a clear CommandError."""
    result = _relay_once(_closed_database_env(relay_env))
    _assert_clear(result, "PostgreSQL cannot be reached")
    assert "secret-pw" not in result.stdout + result.stderr


def test_unreachable_database_at_start_is_one_line(relay_env: dict[str, Any]) -> None:
    """The message for a closed database port is a single line."""
    result = _relay_once(_closed_database_env(relay_env))
    assert len(_assert_clear(result, "PostgreSQL")) == 1
