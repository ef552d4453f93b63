"""The relay as a real subprocess, against a real PostgreSQL and a real Redis."""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import time
from typing import Any

import pytest
from django.db import connection, transaction

from outbox_notify.models import DeadLetter, OutboxMessage
from tests.celery_app import add, app
from tests.relay_support import RedisQueue, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay runs in another process and sees only committed rows.

FAST = ["--sweep-interval", "1", "--backoff-time", "0.2", "--max-backoff", "1"]


def ready(relay: Any) -> None:
    """Wait until the relay is past its start-up check of PostgreSQL and the broker.

    outbox.database_connected comes earlier, while the broker is still being checked: a
    fault test that froze the broker at that moment saw a start-up failure, not an outage.
    """
    wait_for(
        lambda: "outbox.relay_started" in relay.output(),
        what="relay start",
        context=relay.output,
    )


def enqueue(queue: str, count: int = 1, **options: Any) -> list[str]:
    """Commit `count` tasks routed to `queue`; return their ids."""
    with transaction.atomic():
        return [add.apply_async((n, n), queue=queue, **options).id for n in range(count)]


def insert_raw(**columns: Any) -> None:
    """Write a row straight into the table, as a buggy or newer writer might."""
    values = {
        "task_id": "raw",
        "task_name": "tests.add",
        "args": "[]",
        "kwargs": "{}",
        "options": "{}",
        "schema_version": 1,
    }
    values.update(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox_notify_message_v1 (task_id, task_name, args, kwargs, options, schema_version)"
            " VALUES (%(task_id)s, %(task_name)s, %(args)s::json, %(kwargs)s::json, %(options)s::json, %(schema_version)s)",
            values,
        )


def test_commit_is_published_and_row_deleted(start_relay: Any, redis_queue: RedisQueue) -> None:
    """A committed task reaches the broker with its task id, and the row is deleted."""
    relay = start_relay(*FAST)
    ready(relay)
    [task_id] = enqueue(redis_queue.name)
    wait_for(
        lambda: task_id in redis_queue.task_ids(), what="the message in Redis", context=relay.output
    )
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the row deleted")
    [message] = redis_queue.messages()
    assert message["headers"]["task"] == "tests.add"
    assert message["body"][0] == [0, 0]


def test_rollback_is_never_published(start_relay: Any, redis_queue: RedisQueue) -> None:
    """A rolled-back task never reaches the broker; a later commit does."""
    relay = start_relay(*FAST)
    ready(relay)
    with pytest.raises(RuntimeError), transaction.atomic():
        add.apply_async((1, 1), queue=redis_queue.name)
        raise RuntimeError("roll back")
    [kept] = enqueue(redis_queue.name)
    wait_for(lambda: kept in redis_queue.task_ids(), what="the committed message")
    assert redis_queue.task_ids() == [kept]


def test_notify_wakes_a_relay_long_before_its_sweep(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """With a 60 s sweep interval, only a NOTIFY can explain a publish within seconds."""
    relay = start_relay("--sweep-interval", "60", "--stale-timeout", "120")
    ready(relay)
    time.sleep(0.5)  # let it finish its first sweep and fall asleep holding the wake lock
    [task_id] = enqueue(redis_queue.name)
    wait_for(
        lambda: task_id in redis_queue.task_ids(),
        timeout=10,
        what="a notified publish",
        context=relay.output,
    )


def test_poll_only_relay_publishes_on_its_sweep(start_relay: Any, redis_queue: RedisQueue) -> None:
    """--poll-only never LISTENs; the sweep timer alone publishes new rows."""
    relay = start_relay("--poll-only", "--sweep-interval", "0.5")
    ready(relay)
    [task_id] = enqueue(redis_queue.name)
    wait_for(
        lambda: task_id in redis_queue.task_ids(), what="a swept publish", context=relay.output
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox_notify.listen'"
            " AND datname = current_database()"
        )
        assert cursor.fetchone()[0] == 0


def test_two_relays_publish_each_message_once(start_relay: Any, redis_queue: RedisQueue) -> None:
    """Two relays draining one backlog split it: every message exactly once."""
    ids = enqueue(redis_queue.name, count=3000)
    first = start_relay("--batch-size", "50", "--log-batches", *FAST)
    second = start_relay("--batch-size", "50", "--log-batches", *FAST)
    wait_for(
        lambda: not OutboxMessage.objects.exists(), what="the backlog drained", context=first.output
    )
    published = redis_queue.task_ids()
    assert sorted(published) == sorted(ids)
    # --log-batches: one info line per batch
    assert re.search(r"\[info +\] outbox\.batch_done", first.output() + second.output())


def test_retry_due_time_is_honoured_without_polling(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """A row whose retry falls due in 2 s is published after that, with a 60 s sweep."""
    [task_id] = enqueue(redis_queue.name)
    OutboxMessage.objects.update(
        retries=1, retry_after=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    )
    started = time.monotonic()
    relay = start_relay("--sweep-interval", "60", "--stale-timeout", "120")
    wait_for(
        lambda: task_id in redis_queue.task_ids(),
        timeout=15,
        what="the due retry",
        context=relay.output,
    )
    assert time.monotonic() - started >= 1.5


def test_failing_message_backs_off_then_dead_letters(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """A message that fails to publish while others succeed is retried, then dead-lettered."""
    [bad] = enqueue(redis_queue.name, compression="no-such-codec")
    relay = start_relay("--max-retries", "2", *FAST)
    [good] = enqueue(redis_queue.name)
    wait_for(lambda: good in redis_queue.task_ids(), what="the good message", context=relay.output)
    dead = wait_for(
        lambda: DeadLetter.objects.filter(task_id=bad).first(),
        what="the dead letter",
        context=relay.output,
    )
    assert dead.retries == 2  # CONTRACT: dead-lettered after --max-retries ordinary failures
    assert "publish failed 2 times" in dead.failure_reason
    assert "no-such-codec" in dead.failure_reason
    assert not OutboxMessage.objects.exists()
    assert bad not in redis_queue.task_ids()


def test_poison_rows_are_dead_lettered_and_future_rows_left_alone(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """Undecodable rows go to the dead letters with a reason; rows of a newer schema stay put."""
    insert_raw(task_id="bad-options", options=json.dumps({"headers": "not an object"}))
    insert_raw(task_id="not-json-object", options="[1, 2]")
    insert_raw(task_id="old-version", schema_version=0)
    insert_raw(task_id="from-the-future", schema_version=99)
    relay = start_relay(*FAST)
    [good] = enqueue(redis_queue.name)
    wait_for(lambda: good in redis_queue.task_ids(), what="the good message", context=relay.output)
    wait_for(
        lambda: DeadLetter.objects.count() == 3, what="three dead letters", context=relay.output
    )
    reasons = dict(DeadLetter.objects.values_list("task_id", "failure_reason"))
    assert all(reason.startswith("undecodable:") for reason in reasons.values())
    assert "schema_version 0" in reasons["old-version"]
    future = OutboxMessage.objects.get()
    assert (future.task_id, future.retries, future.retry_after) == ("from-the-future", 0, None)


def test_sigterm_exits_zero(start_relay: Any, redis_queue: RedisQueue) -> None:
    """SIGTERM makes an idle relay exit 0 promptly."""
    relay = start_relay(*FAST)
    ready(relay)
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0
    assert "outbox.relay_stopped" in relay.output()


def test_sigterm_mid_backlog_leaves_rows_claimable(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """SIGTERM while draining: exit 0, and what was not published is free for the next relay."""
    ids = enqueue(redis_queue.name, count=3000)
    relay = start_relay("--batch-size", "20", *FAST)
    wait_for(redis_queue.task_ids, what="publishing started", context=relay.output)
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=30) == 0
    left = OutboxMessage.objects.count()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM (SELECT 1 FROM outbox_notify_message_v1 FOR UPDATE NOWAIT) AS free"
        )
        assert cursor.fetchone()[0] == left
    start_relay(*FAST)
    wait_for(lambda: not OutboxMessage.objects.exists(), what="the rest drained")
    assert set(redis_queue.task_ids()) == set(ids)


def test_liveness_file_is_touched_while_idle(
    start_relay: Any, redis_queue: RedisQueue, tmp_path: Any
) -> None:
    """An idle relay keeps refreshing its liveness file."""
    path = tmp_path / "alive"
    relay = start_relay("--liveness-file", str(path), "--sweep-interval", "0.5")
    ready(relay)
    first = wait_for(lambda: path.exists() and path.stat().st_mtime, what="liveness file")
    wait_for(lambda: path.stat().st_mtime > first, timeout=10, what="a later touch")


def test_sweep_publishes_everything_and_exits_zero(
    start_relay: Any, redis_queue: RedisQueue
) -> None:
    """outbox_sweep publishes all due rows, exits 0 and says so in one line; no line per batch
    unless --log-batches asks for it."""
    ids = enqueue(redis_queue.name, count=250)
    sweep = start_relay("--batch-size", "100", command="outbox_sweep")
    assert sweep.wait() == 0, sweep.output()
    assert sorted(redis_queue.task_ids()) == sorted(ids)
    assert not OutboxMessage.objects.exists()
    output = sweep.output()
    assert "published 250, retried 0, dead-lettered 0 (3 batches)" in output
    assert "batch_done" not in output


@pytest.mark.parametrize("broken", ["database", "broker"])
def test_sweep_exits_non_zero_when_a_service_is_unreachable(
    start_relay: Any, relay_env: dict[str, Any], broken: str
) -> None:
    """outbox_sweep exits non-zero with a one-line message when PostgreSQL or the broker is down."""
    env = dict(relay_env)
    if broken == "database":
        env["OUTBOX_TEST_DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/postgres"
    else:
        env["OUTBOX_TEST_BROKER_URL"] = "redis://127.0.0.1:1/0"
    sweep = start_relay(command="outbox_sweep", env=env)
    assert sweep.wait() != 0
    output = sweep.output()
    assert (
        "PostgreSQL cannot be reached" if broken == "database" else "broker cannot be reached"
    ) in output
    assert "Traceback" not in output


def test_send_task_through_the_app_is_routed_like_celery(
    redis_queue: RedisQueue, start_relay: Any
) -> None:
    """send_task by name with custom headers and priority arrives with them."""
    relay = start_relay(*FAST)
    with transaction.atomic():
        result = app.send_task(
            "remote.thing", args=[1], queue=redis_queue.name, headers={"x-a": "b"}
        )
    wait_for(lambda: result.id in redis_queue.task_ids(), what="the message", context=relay.output)
    [message] = redis_queue.messages()
    assert message["headers"]["x-a"] == "b"
    assert message["headers"]["task"] == "remote.thing"
