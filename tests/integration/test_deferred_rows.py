"""Rows wait for the caller's next statement or COMMIT, against a real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import django
import psycopg
import pytest
from django.db import DatabaseError, OperationalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from structlog.testing import capture_logs

from outbox_notify import _compat, bulk
from outbox_notify._write import deferred, rows
from outbox_notify.models import OutboxMessage
from outbox_notify.serialization import OutboxRow
from tests.celery_app import add, app
from tests.relay_support import ROOT

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True throughout: these tests are about what a commit or a rollback leaves in
# the table, which a test wrapped in one rolled-back transaction could not show.


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every write of deferred rows (one entry per round trip)."""
    sizes: list[int] = []
    real = rows.write_rows

    def counting(conn: Any, batch: Sequence[OutboxRow]) -> None:
        sizes.append(len(batch))
        real(conn, batch)

    monkeypatch.setattr(rows, "write_rows", counting)
    state = deferred.pending(connections["default"])
    if state is not None:
        monkeypatch.setattr(state, "writer", counting)
    return sizes


def raw_count() -> int:
    """Rows of the outbox table as this transaction sees them, bypassing Django's cursor."""
    cursor = connection.connection.execute("SELECT count(*) FROM outbox_notify_message_v1")
    found = cursor.fetchone()
    assert found is not None
    return int(found[0])


def test_a_row_waits_for_the_callers_next_statement(writes: list[int]) -> None:
    """The INSERT is not sent at the call; the next statement (here a query of it) sends it."""
    with transaction.atomic():
        add.delay(1, 1)
        assert writes == []
        assert raw_count() == 0  # nothing reached PostgreSQL yet
        assert OutboxMessage.objects.count() == 1  # the query wrote it first, then saw it
        assert writes == [1]


def test_a_transaction_writes_its_rows_in_one_round_trip_before_commit(writes: list[int]) -> None:
    """100 calls in one transaction: one COPY when it commits, every row committed."""
    with transaction.atomic():
        results = [add.delay(i, i) for i in range(100)]
        assert writes == []
    assert writes == [100]
    assert set(OutboxMessage.objects.values_list("task_id", flat=True)) == {r.id for r in results}


def test_a_rollback_forgets_the_rows_and_the_next_transaction_starts_clean() -> None:
    """Rolled back before anything was written: nothing remains, and nothing leaks forward."""
    with pytest.raises(RuntimeError), transaction.atomic():
        add.delay(1, 1)
        raise RuntimeError("roll back")
    with transaction.atomic():
        kept = add.delay(2, 2)
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == [kept.id]


def test_a_savepoint_rollback_drops_only_the_rows_after_it() -> None:
    """An inner atomic() that raises loses its rows; the outer block's rows commit."""
    with transaction.atomic():
        kept = add.delay(1, 1)
        with pytest.raises(RuntimeError), transaction.atomic():
            add.delay(2, 2)
            raise RuntimeError("roll back the savepoint")
        also = add.delay(3, 3)
    assert set(OutboxMessage.objects.values_list("task_id", flat=True)) == {kept.id, also.id}


def test_a_released_savepoint_leaves_its_rows_waiting_and_a_new_one_writes_them(
    writes: list[int],
) -> None:
    """RELEASE SAVEPOINT changes nothing for waiting rows; creating a savepoint writes them
    first (a later ROLLBACK TO it must not take them along)."""
    with transaction.atomic():
        add.delay(0, 0)
        with transaction.atomic():  # SAVEPOINT: the waiting row is written before it
            add.delay(1, 1)
        assert writes == [1]  # the RELEASE did not write the inner block's row
        add.delay(2, 2)
    assert writes == [1, 2]
    assert OutboxMessage.objects.count() == 3


@pytest.fixture
def locked_table() -> Iterator[None]:
    """Another session holds the outbox table locked, so an INSERT into it waits."""
    params = connection.get_connection_params()
    with psycopg.connect(**params) as other:
        other.execute("LOCK TABLE outbox_notify_message_v1 IN ACCESS EXCLUSIVE MODE")
        yield
        other.rollback()


def test_a_database_failure_when_writing_fails_the_commit_and_keeps_nothing(
    locked_table: None,
) -> None:
    """The rows cannot be written (lock timeout): COMMIT raises, saying why; nothing commits."""
    with pytest.raises(OperationalError) as failed, transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '200ms'")
        add.delay(1, 1)
    assert "deferred outbox rows" in "".join(getattr(failed.value, "__notes__", []))


def test_a_database_failure_surfaces_at_the_next_statement(locked_table: None) -> None:
    """The next statement raises the write's error (with the note) before it runs itself."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '200ms'")
        add.delay(1, 1)
        with pytest.raises(OperationalError) as failed, connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        transaction.set_rollback(True)
    assert "deferred outbox rows" in "".join(getattr(failed.value, "__notes__", []))


def test_in_a_failed_transaction_the_call_itself_raises() -> None:
    """After a failed statement the call raises at once, as an INSERT at the call would."""
    with transaction.atomic():
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
        with pytest.raises(DatabaseError, match="current transaction is aborted"):
            add.delay(1, 1)
        transaction.set_rollback(True)


def test_a_transaction_marked_for_rollback_refuses_the_call() -> None:
    """After an inner atomic(savepoint=False) failed, Django's refusal comes at the call."""
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic(savepoint=False):
            raise RuntimeError("inner failure")
        with pytest.raises(TransactionManagementError):
            add.delay(1, 1)


def test_while_django_logs_queries_rows_are_written_at_the_call() -> None:
    """assertNumQueries and DEBUG see the INSERT where the call is, as before."""
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        add.delay(1, 1)
        assert any("INSERT INTO outbox_notify_message_v1" in q["sql"] for q in queries)


def test_a_non_ascii_task_name_is_written_at_the_call() -> None:
    """A name only some server encodings can store is tried at the call, not later."""
    with transaction.atomic():
        app.send_task("tâche.à.faire", (1,))
        assert raw_count() == 1


def test_waiting_rows_are_bounded(monkeypatch: pytest.MonkeyPatch, writes: list[int]) -> None:
    """Past MAX_PENDING rows the waiting ones are written (memory stays bounded)."""
    monkeypatch.setattr(deferred, "MAX_PENDING", 3)
    with transaction.atomic():
        for i in range(7):
            add.delay(i, i)
        assert writes == [3, 3]
    assert writes == [3, 3, 1]
    assert OutboxMessage.objects.count() == 7


def test_rows_keep_the_order_of_the_calls_across_single_calls_and_bulk() -> None:
    """Waiting rows are written before a bulk block's rows: ids follow the calls."""
    with transaction.atomic():
        ids = [add.delay(0, 0).id]
        with bulk():
            ids += [add.delay(i, i).id for i in (1, 2)]
        ids.append(add.delay(3, 3).id)
    stored = list(OutboxMessage.objects.order_by("id").values_list("task_id", flat=True))
    assert stored == ids


def test_a_users_execute_wrapper_is_unaffected() -> None:
    """connection.execute_wrapper() blocks see every statement and remove only themselves."""
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with transaction.atomic():
        add.delay(1, 1)  # hooks the outbox in first
        with connection.execute_wrapper(wrapper):
            add.delay(2, 2)
            assert OutboxMessage.objects.count() == 2
    assert [deferred.is_ours(w) for w in connections["default"].execute_wrappers] == [True]
    assert any("outbox_notify_message_v1" in sql for sql in seen)


# -- Django's private hooks: gated, probed, and the psycopg connection's own commits ----------


@pytest.fixture
def reprobe() -> Iterator[None]:
    """The hooks are probed afresh in this test, and again after it."""
    deferred.forget_probes()
    yield
    deferred.forget_probes()


def _commit_bypassing_the_hook(self: BaseDatabaseWrapper) -> None:
    """A Django whose commit() talks to psycopg directly, never through `_commit`."""
    self.validate_thread_sharing()
    self.validate_no_atomic_block()
    with self.wrap_database_errors:
        self.connection.commit()
    self.errors_occurred = False
    self.run_commit_hooks_on_set_autocommit_on = True


def _unavailable(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "outbox.deferred_rows_unavailable"]


def test_the_probe_sees_this_djangos_commit_path_use_the_hooks(reprobe: None) -> None:
    """On the Django the suite runs, the probe passes: rows may wait for the COMMIT."""
    assert deferred.hook_problem(connections["default"]) is None


def test_a_django_whose_commit_bypasses_the_hook_gets_rows_written_at_the_call(
    monkeypatch: pytest.MonkeyPatch, reprobe: None
) -> None:
    """The probe catches a commit path without `_commit`: rows go in at the call, none lost."""
    monkeypatch.setattr(BaseDatabaseWrapper, "commit", _commit_bypassing_the_hook)
    with capture_logs() as logs:
        with transaction.atomic():
            first = add.delay(1, 1)
            assert raw_count() == 1  # written at the call
        with transaction.atomic():
            second = add.delay(2, 2)
    stored = set(OutboxMessage.objects.values_list("task_id", flat=True))
    assert stored == {first.id, second.id}
    [event] = _unavailable(logs)  # once per process and reason, not per call
    assert "_commit" in event["reason"]
    assert event["path"] == "at_call"
    assert event["log_level"] == "warning"


def test_outside_the_tested_django_releases_rows_are_written_at_the_call(
    monkeypatch: pytest.MonkeyPatch, reprobe: None
) -> None:
    """A Django release the suite never ran on writes at the call and says why, once."""
    monkeypatch.setattr(_compat, "DJANGO_TESTED", ((1, 0), (1, 11)))
    with capture_logs() as logs:
        with transaction.atomic():
            add.delay(1, 1)
            assert raw_count() == 1
        with transaction.atomic():
            add.delay(2, 2)
    assert OutboxMessage.objects.count() == 2
    [event] = _unavailable(logs)
    assert "outside the tested 1.0-1.11.x" in event["reason"]


def test_a_commit_on_the_psycopg_connection_commits_the_waiting_rows() -> None:
    """connection.connection.commit() inside atomic() writes the waiting rows first: they
    commit with it, and survive the block's later rollback as a row written at the call would."""
    with pytest.raises(RuntimeError), transaction.atomic():
        kept = add.delay(1, 1)
        connection.connection.commit()
        raise RuntimeError("the block rolls back after the raw commit")
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == [kept.id]


def test_a_rollback_on_the_psycopg_connection_forgets_the_waiting_rows() -> None:
    """connection.connection.rollback() drops the rows of the transaction it rolled back;
    they are never written into the next one."""
    with transaction.atomic():
        add.delay(1, 1)
        connection.connection.rollback()
        kept = add.delay(2, 2)
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == [kept.id]


def _available(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "outbox.deferred_rows_available"]


def test_the_first_enqueue_says_once_that_rows_wait_and_why(reprobe: None) -> None:
    """On a tested Django whose probe passed, one info event names the deferred path and why;
    later enqueues log nothing more."""
    with capture_logs() as logs:
        for i in range(2):
            with transaction.atomic():
                add.delay(i, i)
    [event] = _available(logs)
    assert event["log_level"] == "info"
    assert event["path"] == "deferred"
    assert event["database"] == "default"
    assert f"Django {django.get_version()} is in the tested" in event["reason"]
    assert "probe" in event["reason"]
    assert _unavailable(logs) == []


PROBE_AT_START_UP = """
import json
import django

django.setup()  # the app config probes the outbox database's connection class here

from django.db import connection, transaction
from structlog.testing import capture_logs

from outbox_notify._write import deferred
from tests.celery_app import add


def probing_now(connection):
    raise AssertionError("probed in the first caller's transaction, not at start-up")


deferred._probe = probing_now
with capture_logs() as logs, transaction.atomic():
    add.delay(1, 1)
    [(written,)] = connection.connection.execute(
        "SELECT count(*) FROM outbox_notify_message_v1"
    ).fetchall()
    transaction.set_rollback(True)
events = [(e["event"], e.get("path")) for e in logs if e["event"].startswith("outbox.deferred")]
print(json.dumps({"written_at_the_call": written, "events": events}))
"""


def test_the_hooks_are_probed_at_start_up_not_in_the_first_callers_transaction(
    subprocess_env: dict[str, Any],
) -> None:
    """django.setup() runs the probe: a probe that would fail if run at the first delay() is
    never reached, the row waits for the COMMIT, and the deferred path is logged."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE_AT_START_UP],
        cwd=ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "written_at_the_call": 0,
        "events": [["outbox.deferred_rows_available", "deferred"]],
    }


# -- a pooled psycopg connection (Django's OPTIONS["pool"], from Django 5.1) -------------------

POOLED = "pooled"  # tests/settings.py defines it from Django 5.1 on


@pytest.fixture
def pooled() -> Iterator[str]:
    """The pooled alias (one connection) as the outbox database; its pool closed afterwards."""
    try:
        with override_settings(OUTBOX_NOTIFY_DATABASE=POOLED):
            yield POOLED
    finally:
        connections[POOLED].close()
        connections[POOLED].close_pool()


def _calls_from_other_threads(
    state: deferred.Deferred, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """The Deferred's flush/discard/abandon calls made from a thread other than this one."""
    owner = threading.get_ident()
    calls: list[str] = []
    for name in ("flush", "discard", "abandon"):
        method = getattr(state, name)

        def spy(*args: Any, _name: str = name, _method: Any = method) -> Any:
            if threading.get_ident() != owner:
                calls.append(_name)
            return _method(*args)

        monkeypatch.setattr(state, name, spy)
    return calls


def _borrow_commit_and_roll_back(alias: str) -> None:
    """On a thread of its own: a transaction that commits, then one that rolls back."""
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute("SELECT 1")
        with pytest.raises(RuntimeError), transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT 1")
            raise RuntimeError("roll back")
    finally:
        connections.close_all()


if django.VERSION >= (5, 1):  # Django's pool (OPTIONS["pool"]) exists from 5.1

    @pytest.mark.django_db(transaction=True, databases=["default", POOLED])
    def test_a_pooled_connection_given_back_no_longer_acts_for_its_former_owner(
        pooled: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After a Django connection gives its psycopg connection back to the pool, the next
        borrower's commits and rollbacks (another thread) never flush or discard its rows."""
        former = connections[pooled]
        with transaction.atomic(using=pooled):
            first = add.delay(1, 1)  # rows wait on the pooled psycopg connection
        raw = former.connection
        state = deferred.pending(former)
        assert state is not None
        foreign = _calls_from_other_threads(state, monkeypatch)
        former.close()  # back to the pool
        borrower = threading.Thread(target=_borrow_commit_and_roll_back, args=(pooled,))
        borrower.start()
        borrower.join(timeout=60)
        assert not borrower.is_alive()
        assert foreign == []
        with transaction.atomic(using=pooled):
            second = add.delay(2, 2)
        assert former.connection is raw  # the pool lent it back: the test met the same one
        stored = set(OutboxMessage.objects.values_list("task_id", flat=True))
        assert stored == {first.id, second.id}
