"""OnceTask on real Celery workers, fed by a real relay through Redis.

Every delivery of a tests.once.* task is recorded by the worker from Celery's task_prerun and
task_postrun signals (outside the body's transaction, so skipped deliveries are recorded too);
every committed effect is an Effect row. Effects must equal what should have happened once,
whatever the deliveries were.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import states
from django.db import connections, transaction

from outbox_notify.models import InboxRecord
from tests.once_tasks import (
    autoretrying,
    confirm_order,
    effect,
    late,
    retrying,
    swallow,
    swallow_retried,
)
from tests.relay_support import wait_for
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]
# transaction=True: the relay and the workers are other processes; only commits reach them.

FAST = ["--sweep-interval", "1"]
HOLD = 8.0  # seconds the first of two concurrent deliveries keeps its key uncommitted


def records(*paths: Path) -> list[dict[str, Any]]:
    """Every prerun/postrun record the workers wrote, in time order."""
    found = [
        json.loads(line)
        for path in paths
        if path.exists()
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    return sorted(found, key=lambda r: r["at"])


def finished(paths: tuple[Path, ...], task_id: str, count: int) -> list[dict[str, Any]] | None:
    """The postrun records of this task id once there are `count` of them, else None."""
    done = [r for r in records(*paths) if r["event"] == "postrun" and r["id"] == task_id]
    return done if len(done) >= count else None


def wait_finished(
    paths: tuple[Path, ...],
    task_id: str,
    count: int,
    *,
    until: str | None = None,
    timeout: float = 90,
) -> list[dict[str, Any]]:
    """Wait for `count` finished deliveries of the task id (or one in state `until`)."""

    def ready() -> list[dict[str, Any]] | None:
        done = finished(paths, task_id, 1 if until else count)
        if until:
            return done if done and done[-1]["state"] == until else None
        return done

    return list(
        wait_for(
            ready,
            timeout=timeout,
            what=f"{count} finished deliveries of {task_id}",
            context=lambda: "\n".join(json.dumps(r) for r in records(*paths) if r["id"] == task_id),
        )
    )


def deliveries(paths: tuple[Path, ...], task_id: str) -> int:
    return sum(1 for r in records(*paths) if r["event"] == "prerun" and r["id"] == task_id)


def effect_markers() -> list[str]:
    return list(Effect.objects.order_by("id").values_list("marker", flat=True))


def worker_log(tmp_path: Path, index: int = 0) -> str:
    return (tmp_path / f"worker-{index}.log").read_text(errors="replace")


def wait_ready(tmp_path: Path, index: int) -> None:
    """Wait until worker `index` consumes (its 'ready.' line), so deliveries can overlap."""
    wait_for(
        lambda: (
            (tmp_path / f"worker-{index}.log").exists() and " ready." in worker_log(tmp_path, index)
        ),
        timeout=60,
        what=f"worker {index} to be ready",
    )


def test_the_same_task_id_delivered_twice_has_one_effect(
    start_relay: Any, start_worker: Any, queue_name: str, tmp_path: Path
) -> None:
    """Two messages with one task id (a relay or broker duplicate): one effect, one skip."""
    start_relay(*FAST)
    paths = (start_worker(queue_name),)
    task_id = str(uuid.uuid4())
    with transaction.atomic():
        for _ in range(2):
            effect.apply_async(("twice",), task_id=task_id, queue=queue_name)
    done = wait_finished(paths, task_id, 2)
    assert [r["state"] for r in done] == [states.SUCCESS, states.IGNORED]
    assert effect_markers() == ["twice"]
    # An info event is an INFO line of the worker's log (structlog's default logger would
    # print it to the stdout Celery redirects at WARNING).
    [line] = [x for x in worker_log(tmp_path).splitlines() if "outbox.duplicate_skipped" in x]
    assert ": INFO/" in line, line


@pytest.mark.parametrize("task", [retrying, autoretrying], ids=["self.retry", "autoretry_for"])
def test_failed_attempts_leave_no_effect_and_the_last_attempt_one(
    task: Any, start_relay: Any, start_worker: Any, queue_name: str
) -> None:
    """Two failed attempts roll back (retry messages go out through the outbox); one effect."""
    start_relay(*FAST)
    paths = (start_worker(queue_name),)
    with transaction.atomic():
        result = task.apply_async(("retried", 2), queue=queue_name)
    done = wait_finished(paths, result.id, 3, until=states.SUCCESS)
    assert [r["state"] for r in done] == [states.RETRY, states.RETRY, states.SUCCESS]
    assert deliveries(paths, result.id) == 3
    assert list(Effect.objects.values_list("marker", "attempt")) == [("retried", 2)]
    assert InboxRecord.objects.filter(task_id=result.id).count() == 1


def test_a_raising_body_leaves_no_key_and_no_effect(
    start_relay: Any, start_worker: Any, queue_name: str
) -> None:
    """A failure on a worker rolls back the body's effects, its enqueued tasks and its key."""
    start_relay(*FAST)
    paths = (start_worker(queue_name),)
    with transaction.atomic():
        result = effect.apply_async(
            ("rolled-back",), {"fail": True, "enqueue": True}, queue=queue_name
        )
    [done] = wait_finished(paths, result.id, 1)
    assert done["state"] == states.FAILURE
    assert effect_markers() == []
    assert not InboxRecord.objects.filter(task_id=result.id).exists()
    # The body's record.delay() was rolled back too: the worker never saw tests.record.
    assert [r["name"] for r in records(*paths)] == ["tests.once.effect", "tests.once.effect"]


def test_a_body_that_returns_with_its_transaction_marked_for_rollback_fails_visibly(
    start_relay: Any, start_worker: Any, queue_name: str, tmp_path: Path
) -> None:
    """A caught database error or set_rollback(True) ends FAILURE (or retried), never SUCCESS
    with nothing committed: no effect and no key, so a redelivery would run the body again."""
    start_relay(*FAST)
    paths = (start_worker(queue_name),)
    with transaction.atomic():
        lost = [
            swallow.apply_async((how, how), queue=queue_name)
            for how in ("orm", "raw", "set_rollback")
        ]
        retried = swallow_retried.apply_async(("retried", 1), queue=queue_name)
    for result in lost:
        [done] = wait_finished(paths, result.id, 1)
        assert done["state"] == states.FAILURE
    done = wait_finished(paths, retried.id, 2, until=states.SUCCESS)
    assert [r["state"] for r in done] == [states.RETRY, states.SUCCESS]
    assert list(Effect.objects.values_list("marker", "attempt")) == [("retried", 1)]
    assert list(InboxRecord.objects.values_list("task_id", flat=True)) == [retried.id]
    assert (
        worker_log(tmp_path).count("MarkedForRollback: the body of tests.once.swallow returned")
        == 3
    )


def test_one_business_key_from_two_task_ids_has_one_effect(
    start_relay: Any, start_worker: Any, queue_name: str
) -> None:
    """once_key: order 17 confirmed by two requests (two task ids) is confirmed once."""
    start_relay(*FAST)
    paths = (start_worker(queue_name),)
    with transaction.atomic():
        first = confirm_order.apply_async((17, "first-request"), queue=queue_name)
    with transaction.atomic():
        second = confirm_order.apply_async((17, "second-request"), queue=queue_name)
    [one] = wait_finished(paths, first.id, 1)
    [two] = wait_finished(paths, second.id, 1)
    assert (one["state"], two["state"]) == (states.SUCCESS, states.IGNORED)
    assert effect_markers() == ["first-request"]


def _waiting_on_the_key() -> bool:
    """Whether a worker's session waits on a lock inside the inbox insert right now."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%INSERT INTO outbox_notify_inbox_v1%"],
        )
        return bool(cur.fetchone()[0])


def test_two_concurrent_deliveries_one_runs_the_other_waits_then_skips(
    start_relay: Any, start_worker: Any, queue_name: str, tmp_path: Path
) -> None:
    """Two workers get the same task id at once: one runs, the other waits on the key, skips."""
    queues = (f"{queue_name}-a", f"{queue_name}-b")
    start_relay(*FAST)
    paths = (start_worker(queues[0]), start_worker(queues[1]))
    wait_ready(tmp_path, 0)
    wait_ready(tmp_path, 1)
    task_id = str(uuid.uuid4())
    with transaction.atomic():
        for queue in queues:
            effect.apply_async((queue,), {"sleep": HOLD}, task_id=task_id, queue=queue)
    wait_for(_waiting_on_the_key, timeout=60, what="one delivery to wait on the other's key")
    wait_finished(paths, task_id, 2)
    # One worker per file: (start, end, state) of each worker's delivery.
    runs = {}
    for path in paths:
        prerun, postrun = records(path)
        runs[postrun["state"]] = (prerun["at"], postrun["at"])
    assert set(runs) == {states.SUCCESS, states.IGNORED}
    ran, skipped = runs[states.SUCCESS], runs[states.IGNORED]
    assert skipped[0] < ran[1], "the skipped delivery only started after the other had finished"
    assert len(effect_markers()) == 1
    assert effect_markers()[0] in queues


def _holding_the_key() -> bool:
    """Whether a worker's session sits inside a body's transaction (key and effect written)."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle in transaction' AND query LIKE %s",
            ["%testapp_effect%"],
        )
        return bool(cur.fetchone()[0])


# kombu 5.3 sweeps unacknowledged Redis messages on every tenth 10 s tick (about 100 s), 5.7 on
# every tick: the redelivery after a kill waits for that sweep.
RESTORE_DEADLINE = 240  # seconds


@pytest.mark.timeout(RESTORE_DEADLINE + 150)
def test_a_worker_killed_mid_body_is_redelivered_and_runs_once(
    start_relay: Any,
    start_worker: Any,
    relay_env: dict[str, Any],
    private_redis: Any,
    queue_name: str,
) -> None:
    """acks_late, SIGKILL inside the body: its transaction dies with it; the redelivery runs."""
    # A private Redis: the short visibility timeout restores every unacknowledged message of
    # the database it runs on, which must not be other tests' messages.
    env = dict(
        relay_env,
        OUTBOX_TEST_BROKER_URL=private_redis.url(),
        OUTBOX_TEST_RESULT_BACKEND=private_redis.url(),
        OUTBOX_TEST_VISIBILITY_TIMEOUT="2",
    )
    start_relay(*FAST, env=env)
    doomed = start_worker(queue_name, env=dict(env, OUTBOX_TEST_BODY_SLEEP="120"))
    with transaction.atomic():
        result = late.apply_async(("crash",), queue=queue_name)
    wait_for(_holding_the_key, timeout=60, what="the body to hold its key uncommitted")
    [first] = [r for r in records(doomed) if r["event"] == "prerun"]
    os.kill(first["pid"], signal.SIGKILL)
    paths = (doomed, start_worker(queue_name, env=env))
    [done] = wait_finished(paths, result.id, 1, timeout=RESTORE_DEADLINE)
    assert done["state"] == states.SUCCESS
    assert deliveries(paths, result.id) == 2
    assert list(Effect.objects.values_list("marker", flat=True)) == ["crash"]
    assert InboxRecord.objects.filter(task_id=result.id).count() == 1
