"""OnceTask in the test process against a real PostgreSQL: the inbox, retries, concurrency.

Tasks run through Celery's own tracer, eagerly (`apply`) as tests and `task_always_eager` run
them, and in-process the way a worker runs a delivery (`deliver` below). Real workers are in
tests/acceptance/test_once_worker.py.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import structlog
from celery import states
from celery.app.trace import build_tracer
from django.db import InternalError, connections, transaction
from django.test.utils import CaptureQueriesContext

from outbox_notify import OnceTask, inbox, signals
from outbox_notify.exceptions import MarkedForRollback, OnceKeyError
from outbox_notify.models import InboxRecord, OutboxMessage
from tests.celery_app import app
from tests.once_tasks import (
    GATES,
    MAX_RETRIES,
    Gate,
    autoretrying,
    commit_fails,
    confirm_order,
    effect,
    isolation,
    retrying,
    ship_order,
    swallow,
    swallow_retried,
)
from tests.relay_support import wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: what a body commits is the point, and the concurrency tests run deliveries
# on other connections, which see only committed rows.


def new_id() -> str:
    return str(uuid.uuid4())


def effects(marker: str | None = None) -> list[Effect]:
    rows = Effect.objects.order_by("id")
    return list(rows.filter(marker=marker) if marker else rows)


def keys() -> list[tuple[str, str, str]]:
    return list(InboxRecord.objects.order_by("id").values_list("scope", "key", "task_id"))


def deliver(task: Any, args: tuple[Any, ...], task_id: str, retries: int = 0) -> Any:
    """Run one delivery as a worker would (not eager): Celery's tracer, no result stored."""
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    request = {"id": task_id, "retries": retries, "ignore_result": True, "delivery_info": {}}
    return tracer(task_id, args, {}, request)


@pytest.fixture
def skipped() -> Iterator[list[dict[str, Any]]]:
    """What outbox_duplicate_skipped receivers got, one dict per signal."""
    received: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        received.append({"sender": sender, **kwargs})

    signals.outbox_duplicate_skipped.connect(receiver)
    yield received
    signals.outbox_duplicate_skipped.disconnect(receiver)


def test_a_delivery_commits_its_key_and_its_effects_together() -> None:
    """The body's return value is the result; the inbox holds (task name, task id)."""
    task_id = new_id()
    result = effect.apply(("one",), task_id=task_id)
    assert (result.state, result.result) == (states.SUCCESS, "one")
    assert [e.task_id for e in effects("one")] == [task_id]
    assert keys() == [("tests.once.effect", task_id, task_id)]


def test_a_second_delivery_of_a_committed_id_is_skipped_logged_and_signalled(
    skipped: list[dict[str, Any]],
) -> None:
    """Same task id again: the body does not run; Celery's state is IGNORED (result untouched)."""
    task_id = new_id()
    effect.apply(("first",), task_id=task_id)
    with structlog.testing.capture_logs() as logs:
        again = effect.apply(("second",), task_id=task_id)
    assert again.state == states.IGNORED
    assert [e.marker for e in effects()] == ["first"]
    [event] = [e for e in logs if e["event"] == "outbox.duplicate_skipped"]
    assert event == {
        "event": "outbox.duplicate_skipped",
        "log_level": "info",
        "task_id": task_id,
        "task_name": "tests.once.effect",
        "scope": "tests.once.effect",
        "key_from": "task_id",
        "first_task_id": task_id,
    }
    assert skipped == [
        {
            "sender": "outbox_notify",
            "signal": signals.outbox_duplicate_skipped,
            "task_id": task_id,
            "task_name": "tests.once.effect",
            "scope": "tests.once.effect",
            "key": task_id,
            "first_task_id": task_id,
        }
    ]


def test_a_raising_body_leaves_no_key_and_no_effect_and_runs_again() -> None:
    """A failure rolls key and effects back together; the next delivery of the id runs."""
    task_id = new_id()
    failed = effect.apply(("boom",), {"fail": True}, task_id=task_id)
    assert failed.state == states.FAILURE
    assert isinstance(failed.result, RuntimeError)
    assert (effects(), keys()) == ([], [])
    again = effect.apply(("fixed",), task_id=task_id)
    assert again.state == states.SUCCESS
    assert [e.marker for e in effects()] == ["fixed"]


def test_tasks_the_body_enqueues_commit_and_roll_back_with_it() -> None:
    """task.delay() in the body writes its outbox row in the body's transaction."""
    effect.apply(("kept",), {"enqueue": True})
    effect.apply(("dropped",), {"enqueue": True, "fail": True})
    rows = OutboxMessage.objects.filter(task_name="tests.record")
    assert [row.args for row in rows] == [["kept"]]


def test_self_retry_rolls_back_every_failed_attempt() -> None:
    """self.retry(): attempts 0 and 1 leave nothing; attempt 2's effect commits, once."""
    result = retrying.apply(("retried", 2))
    assert (result.state, result.result) == (states.SUCCESS, 2)
    assert [e.attempt for e in effects("retried")] == [2]
    assert len(keys()) == 1


def test_autoretry_for_rolls_back_every_failed_attempt() -> None:
    """autoretry_for: the same as self.retry(), through Celery's autoretry wrapper."""
    result = autoretrying.apply(("auto", 3))
    assert (result.state, result.result) == (states.SUCCESS, 3)
    assert [e.attempt for e in effects("auto")] == [3]


def test_autoretry_for_covers_a_failing_commit() -> None:
    """An error raised by COMMIT (after the body returned) is retried by autoretry_for too."""
    result = commit_fails.apply(("at-commit", 2))
    assert (result.state, result.result) == (states.SUCCESS, 2)
    assert [e.attempt for e in effects("at-commit")] == [2]


def test_retries_exhausted_leave_no_key_and_no_effect() -> None:
    """After max_retries the task fails with nothing committed, so a redelivery would run."""
    result = autoretrying.apply(("exhausted", MAX_RETRIES + 5))
    assert result.state == states.FAILURE
    assert isinstance(result.result, RuntimeError)
    assert (effects(), keys()) == ([], [])


def test_a_worker_retry_sends_the_retry_message_after_the_rollback() -> None:
    """Not eager: the retry message (same id, retries+1) reaches the outbox; the attempt does not."""
    task_id = new_id()
    outcome = deliver(retrying, ("worker", 1), task_id)
    assert outcome.info.state == states.RETRY
    assert (effects(), keys()) == ([], [])
    [row] = OutboxMessage.objects.filter(task_name="tests.once.retry")
    assert row.task_id == task_id
    assert row.options["headers"]["retries"] == 1
    assert deliver(retrying, ("worker", 1), task_id, retries=1).info is None  # succeeded
    assert [e.attempt for e in effects("worker")] == [1]


@pytest.mark.parametrize("how", ["orm", "raw", "set_rollback"])
def test_a_body_that_returns_with_its_transaction_marked_for_rollback_fails(how: str) -> None:
    """A caught database error or set_rollback(True): FAILURE, no effect, no key; it runs again."""
    task_id = new_id()
    outcome = deliver(swallow, ("lost", how), task_id)
    assert outcome.info.state == states.FAILURE
    assert isinstance(outcome.info.retval, MarkedForRollback)
    assert "the body of tests.once.swallow returned" in str(outcome.info.retval)
    assert (effects(), keys()) == ([], [])
    assert deliver(swallow, ("again", None), task_id).info is None  # succeeded
    assert [e.marker for e in effects()] == ["again"]


def test_autoretry_for_retries_a_body_marked_for_rollback() -> None:
    """autoretry_for=(MarkedForRollback,): the attempts that swallowed an error are retried."""
    result = swallow_retried.apply(("retried", 2))
    assert (result.state, result.result) == (states.SUCCESS, 2)
    assert [e.attempt for e in effects("retried")] == [2]
    assert len(keys()) == 1


def test_a_worker_duplicate_is_ignored_not_failed() -> None:
    """In a worker's tracer the duplicate ends IGNORED, which Celery acknowledges."""
    task_id = new_id()
    assert deliver(effect, ("first",), task_id).info is None
    outcome = deliver(effect, ("again",), task_id)
    assert outcome.info.state == states.IGNORED
    assert [e.marker for e in effects()] == ["first"]


def test_a_direct_call_is_a_plain_function_call() -> None:
    """task(...) runs the body without a delivery: nothing recorded, nothing skipped."""
    assert effect("direct") == "direct"
    assert effect("direct") == "direct"
    assert len(effects("direct")) == 2
    assert keys() == []


def test_task_always_eager_records_the_key() -> None:
    """With task_always_eager, delay() runs the body in the inbox like apply()."""
    app.conf.task_always_eager = True
    try:
        result = effect.delay("eager")
    finally:
        app.conf.task_always_eager = False
    assert result.state == states.SUCCESS
    assert keys() == [("tests.once.effect", result.id, result.id)]


def test_a_business_key_runs_once_per_key_whatever_the_task_id(
    skipped: list[dict[str, Any]],
) -> None:
    """once_key: two messages for order 17 (two task ids) -> one effect; order 18 runs too."""
    first = confirm_order.apply((17, "first"))
    second = confirm_order.apply((17, "second"))
    other = confirm_order.apply((18, "other"))
    assert [first.state, second.state, other.state] == [
        states.SUCCESS,
        states.IGNORED,
        states.SUCCESS,
    ]
    assert [e.marker for e in effects()] == ["first", "other"]
    assert [s["first_task_id"] for s in skipped] == [first.id]
    assert skipped[0]["key"] == "order:17"
    assert ("tests.once.confirm", "order:17", first.id) in keys()


def test_two_tasks_with_the_same_key_do_not_collide() -> None:
    """Keys are scoped by task name: confirm and ship of order 17 both run."""
    confirm_order.apply((17, "confirm"))
    ship_order.apply((17, "ship"))
    assert [e.marker for e in effects()] == ["confirm", "ship"]


def test_tasks_sharing_a_scope_share_their_keys() -> None:
    """once_scope set on two tasks makes a key recorded by one skip the other."""

    @app.task(
        name="tests.once.scoped_a", base=OnceTask, bind=True, once_scope="orders", once_key=str
    )
    def scoped_a(self: Any, order_id: int) -> None:
        Effect.objects.create(marker="a", task_id=self.request.id, attempt=0)

    @app.task(
        name="tests.once.scoped_b", base=OnceTask, bind=True, once_scope="orders", once_key=str
    )
    def scoped_b(self: Any, order_id: int) -> None:
        Effect.objects.create(marker="b", task_id=self.request.id, attempt=0)

    assert scoped_a.apply((5,)).state == states.SUCCESS
    assert scoped_b.apply((5,)).state == states.IGNORED
    assert [e.marker for e in effects()] == ["a"]
    assert keys()[0][:2] == ("orders", "5")


def test_a_key_that_cannot_be_stored_fails_at_the_call_and_writes_nothing() -> None:
    """apply_async() runs once_key first: a bad key raises OnceKeyError in the caller."""
    with pytest.raises(OnceKeyError, match="NUL"), transaction.atomic():
        confirm_order.apply_async(("a\x00b", "nul"))
    assert not OutboxMessage.objects.exists()


def test_a_key_that_cannot_be_stored_fails_the_delivery() -> None:
    """A message that reaches a worker with an unfit key fails; nothing is recorded."""
    result = confirm_order.apply(("x" * 300, "long"))
    assert result.state == states.FAILURE
    assert isinstance(result.result, OnceKeyError)
    assert (effects(), keys()) == ([], [])


# --- two deliveries of one key at the same time ---------------------------------------------


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run target in a thread with its own Django connection; its result lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _waiting_on_a_lock() -> bool:
    """Whether some session of this database waits on a lock inside the inbox insert."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%INSERT INTO outbox_notify_inbox_v1%"],
        )
        return bool(cur.fetchone()[0])


@pytest.fixture
def gate() -> Iterator[tuple[str, Gate]]:
    """A gate a body can wait at, released (and removed) after the test whatever happens."""
    name = uuid.uuid4().hex
    GATES[name] = Gate()
    yield name, GATES[name]
    GATES[name].release.set()
    del GATES[name]


def _race(
    gate: tuple[str, Gate], *, first_fails: bool, isolation: str | None = None
) -> tuple[Any, Any]:
    """Delivery 1 holds the key uncommitted; delivery 2 of the same id starts and must wait."""
    name, held = gate
    task_id = new_id()

    def second() -> Any:
        if isolation:
            with connections["default"].cursor() as cur:
                cur.execute(
                    f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {isolation}"
                )
        return effect.apply(("second",), task_id=task_id)

    one, first_out = _in_thread(lambda: effect.apply(("first",), {"gate": name}, task_id=task_id))
    assert held.entered.wait(30), "the first delivery never reached its gate"
    two, second_out = _in_thread(second)
    wait_for(_waiting_on_a_lock, timeout=30, what="the second delivery to wait on the key")
    assert two.is_alive()
    assert second_out == []
    held.fail = first_fails
    held.release.set()
    one.join(30)
    two.join(30)
    return first_out[0], second_out[0]


def test_a_concurrent_duplicate_waits_for_the_first_then_skips(gate: tuple[str, Gate]) -> None:
    """Two deliveries of one id at once: the second waits on the key, then skips. Never both."""
    first, second = _race(gate, first_fails=False)
    assert (first.state, second.state) == (states.SUCCESS, states.IGNORED)
    assert [e.marker for e in effects()] == ["first"]


def test_a_concurrent_duplicate_runs_when_the_first_rolls_back(gate: tuple[str, Gate]) -> None:
    """If the delivery holding the key fails, the waiting one inserts the key and runs."""
    first, second = _race(gate, first_fails=True)
    assert (first.state, second.state) == (states.FAILURE, states.SUCCESS)
    assert [e.marker for e in effects()] == ["second"]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_concurrent_duplicate_skips_under_stricter_isolation(
    gate: tuple[str, Gate], isolation: str
) -> None:
    """PostgreSQL raises a serialization failure there instead of doing nothing: still a skip."""
    first, second = _race(gate, first_fails=False, isolation=isolation)
    assert (first.state, second.state) == (states.SUCCESS, states.IGNORED)
    assert [e.marker for e in effects()] == ["first"]


def _queries_sent(run: Callable[[], Any], tmp_path: Any) -> list[str]:
    """The statements `run` sends on the default connection, from libpq's protocol trace."""
    connection = connections["default"]
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    trace = tmp_path / "libpq.trace"
    with trace.open("w") as out:
        pgconn.trace(out.fileno())
        try:
            run()
        finally:
            pgconn.untrace()
    # Frontend messages are "<time>\tF\t<length>\tQuery\t\"<text>\"" (text may span lines).
    sent, current = [], None
    for line in trace.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) > 3 and fields[1] in {"F", "B"}:
            if current is not None:
                sent.append(current)
            current = fields[4].strip(' "') if fields[1:4:2] == ["F", "Query"] else None
        elif current is not None:
            current += "\n" + line
    if current is not None:
        sent.append(current)
    return [" ".join(query.split()) for query in sent]


def test_a_delivery_sends_its_key_with_begin_then_its_body_and_commit_nothing_else(
    tmp_path: Any,
) -> None:
    """What one delivery costs in round trips: BEGIN and the key insert travel together."""
    task_id = new_id()
    sent = _queries_sent(lambda: deliver(effect, ("trips",), task_id), tmp_path)
    assert len(sent) == 3, sent
    first, body, commit = sent
    begin, key = first.split("; ", 1)
    assert (begin, commit) == ("BEGIN", "COMMIT")
    # The key insert goes without the SQL file's comments: every execution would carry them.
    assert key.startswith("INSERT INTO outbox_notify_inbox_v1 "), key
    assert task_id in key
    assert "--" not in key
    assert "testapp_effect" in body


@pytest.fixture
def raw_connection() -> Iterator[psycopg.Connection[Any]]:
    """The default alias's psycopg connection; its transaction settings restored afterwards."""
    connection = connections["default"]
    connection.ensure_connection()
    raw = connection.connection
    saved = (raw.isolation_level, raw.read_only, raw.cursor_factory)
    yield raw
    if raw.closed:
        return
    if raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raw.rollback()
    raw.isolation_level, raw.read_only, raw.cursor_factory = saved


def test_the_begin_sent_with_the_key_keeps_the_connections_isolation_level(
    raw_connection: psycopg.Connection[Any], tmp_path: Any
) -> None:
    """Django's isolation_level option (set on psycopg's connection) starts the transaction."""
    raw_connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    sent = _queries_sent(lambda: deliver(isolation, (), new_id()), tmp_path)
    assert sent[0].startswith(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; INSERT INTO outbox_notify_inbox_v1 "
    ), sent
    assert [e.marker for e in effects()] == ["repeatable read"]


def test_a_database_error_in_the_key_insert_is_djangos_and_rolls_back(
    raw_connection: psycopg.Connection[Any], tmp_path: Any
) -> None:
    """PostgreSQL refusing the key (here: a read-only transaction) fails the delivery cleanly."""
    raw_connection.read_only = True
    outcome: list[Any] = []
    sent = _queries_sent(
        lambda: outcome.append(effect.apply(("read-only",), task_id=new_id())), tmp_path
    )
    assert sent[0].startswith("BEGIN READ ONLY; INSERT INTO outbox_notify_inbox_v1 "), sent
    [result] = outcome
    assert result.state == states.FAILURE
    assert isinstance(result.result, InternalError), result.result
    assert "read-only transaction" in str(result.result)
    raw_connection.read_only = None
    # Nothing was recorded, and the connection goes on with a transaction of its own.
    assert raw_connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert keys() == []
    assert effects() == []
    assert effect.apply(("after",), task_id=new_id()).state == states.SUCCESS
    assert [e.marker for e in effects()] == ["after"]


def test_a_watched_connection_sees_the_key_insert_as_a_statement_of_its_own() -> None:
    """With query logging (DEBUG, assertNumQueries) or an execute wrapper, nothing is hidden."""
    task_id = new_id()
    with CaptureQueriesContext(connections["default"]) as captured:
        assert effect.apply(("watched",), task_id=task_id).state == states.SUCCESS
    # Recent Django releases log their BEGIN too: the statements after it are what count.
    sent = [query["sql"] for query in captured.captured_queries if query["sql"] != "BEGIN"]
    assert sent[0].startswith("INSERT INTO outbox_notify_inbox_v1 "), sent
    assert task_id in sent[0]
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(wrapper):
        assert effect.apply(("wrapped",), task_id=new_id()).state == states.SUCCESS
    assert seen[0].startswith("INSERT INTO outbox_notify_inbox_v1 "), seen
    assert [e.marker for e in effects()] == ["watched", "wrapped"]


def test_an_instrumented_cursor_factory_sees_the_key_insert(
    raw_connection: psycopg.Connection[Any], tmp_path: Any
) -> None:
    """A cursor factory other than Django's (a psycopg-level tracer) gets the statement."""
    from django.db.backends.postgresql.base import Cursor

    executed: list[str] = []

    class Traced(Cursor):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            executed.append(str(query))
            return super().execute(query, *args, **kwargs)

    raw_connection.cursor_factory = Traced
    task_id = new_id()
    sent = _queries_sent(lambda: deliver(effect, ("traced",), task_id), tmp_path)
    assert sent[0] == "BEGIN", sent
    assert sent[1].startswith("INSERT INTO outbox_notify_inbox_v1 "), sent
    assert executed[0].startswith("INSERT INTO outbox_notify_inbox_v1 "), executed
    assert keys() == [("tests.once.effect", task_id, task_id)]


def test_inside_a_transaction_under_way_the_key_follows_its_statements(tmp_path: Any) -> None:
    """An eager delivery inside the caller's atomic(): a savepoint, then the key on its own."""
    task_id = new_id()

    def run() -> None:
        with transaction.atomic():
            Effect.objects.count()
            assert effect.apply(("nested",), task_id=task_id).state == states.SUCCESS

    sent = _queries_sent(run, tmp_path)
    assert sent[0] == "BEGIN", sent
    assert sent[1].startswith("SELECT COUNT(*)"), sent
    assert sent[2].startswith("SAVEPOINT "), sent
    assert sent[3].startswith("INSERT INTO outbox_notify_inbox_v1 "), sent
    assert sent[-1] == "COMMIT", sent
    assert [e.marker for e in effects()] == ["nested"]


def test_the_fallback_from_the_fused_begin_is_logged_once_per_process_and_reason(
    raw_connection: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deliveries that cannot send BEGIN with the key say why once, not once per task."""
    from django.db.backends.postgresql.base import Cursor

    class Traced(Cursor):
        pass

    monkeypatch.setattr(inbox, "_reported", set())
    raw_connection.cursor_factory = Traced
    with structlog.testing.capture_logs() as logs:
        for marker in ("first", "second"):
            deliver(effect, (marker,), new_id())
        with CaptureQueriesContext(connections["default"]):
            deliver(effect, ("watched",), new_id())
    reasons = [e["reason"] for e in logs if e["event"] == "outbox.fused_begin_unavailable"]
    assert len(reasons) == 2, reasons
    assert "cursors are not Django's own" in reasons[0]
    assert "watches the connection's statements" in reasons[1]
    assert [e.marker for e in effects()] == ["first", "second", "watched"]
