"""Tasks held in the outbox until their ETA: written held, claimed only when due, published
at the ETA by a real relay to a real Redis, visible in stats, cancellable by revoke."""

from __future__ import annotations

import datetime as dt
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import celery
import psycopg
import pytest
import redis
from celery import group
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client, override_settings
from django.urls import reverse

from outbox_notify import OutboxCelery, bulk, held, stats
from outbox_notify.app import RecordingProducer
from outbox_notify.models import OutboxMessage
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.runner import connection_kwargs
from outbox_notify.relay.store import claimed_rows
from outbox_notify.serialization import SCHEMA_VERSION
from tests.celery_app import add, app
from tests.integration.test_admin import (
    OUTBOX_LIST,
    add_message,
    messages_of,
    operator,
    post_action,
    relay_holds,
)
from tests.relay_support import RedisQueue, claim_params, decode_envelope, wait_for

__all__ = ["operator", "relay_holds"]  # the admin tests' fixtures, shared

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: relays and second sessions see only committed rows.

# The claim query of the releases before holding existed (sql/queries.sql at 737228a): an
# old relay during a rolling upgrade runs exactly this.
OLD_CLAIM = """
SELECT id, task_id FROM outbox_notify_message_v1
WHERE (retry_after IS NULL OR retry_after <= now()) AND schema_version <= 1
ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED
"""
NEW_CLAIM = held.sql_files.queries()["claim_batch"]


def _session(autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(**connection_kwargs("default"), autocommit=autocommit)


def _claim(query: str = NEW_CLAIM, limit: int = 100) -> list[str]:
    """Task ids a relay's claim takes now (released again at once)."""
    with _session(autocommit=False) as conn:
        task_ids = _claimed(conn, query, limit)
        conn.rollback()
    return task_ids


def _claimed(conn: psycopg.Connection[Any], query: str, limit: int) -> list[str]:
    """Task ids one claim takes, by this release's claim or the old one (a new relay's)."""
    if query is not NEW_CLAIM:
        return [
            row[1] for row in conn.execute(query, {"limit": limit, "max_version": SCHEMA_VERSION})
        ]
    records = conn.execute(query, claim_params(limit, max_version=SCHEMA_VERSION)).fetchall()
    rows, _, _ = claimed_rows(records, limit)
    return [row.task_id for row in rows]


def _retry_after(task_id: str) -> dt.datetime | None:
    value: dt.datetime | None = OutboxMessage.objects.get(task_id=task_id).retry_after
    return value


def _eta(task_id: str) -> dt.datetime:
    headers = OutboxMessage.objects.get(task_id=task_id).options["headers"]
    return dt.datetime.fromisoformat(headers["eta"])


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=60)
def test_only_an_eta_beyond_the_setting_is_held() -> None:
    """countdown 61 s is held until its eta header; 59 s and no countdown are ready now."""
    with transaction.atomic():
        far = add.apply_async((1, 1), countdown=61).id
        near = add.apply_async((1, 1), countdown=59).id
        plain = add.delay(1, 1).id
    assert _retry_after(far) == _eta(far)
    assert _retry_after(near) is None
    assert _retry_after(plain) is None


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=None)
def test_none_never_holds() -> None:
    """OUTBOX_NOTIFY_HOLD_ETA_AFTER = None keeps the old behaviour: published at once."""
    with transaction.atomic():
        task_id = add.apply_async((1, 1), countdown=3600).id
    assert _retry_after(task_id) is None


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=60)
def test_explicit_eta_bulk_and_group_rows_are_held() -> None:
    """An eta datetime, tasks in bulk() (COPY) and a group's members are held alike."""
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    with transaction.atomic():
        single = add.apply_async((1, 1), eta=eta).id
    with bulk():
        in_bulk = [add.apply_async((n, n), countdown=7200).id for n in range(3)]
        ready = add.delay(0, 0).id
    with transaction.atomic():
        members = group(add.s(n, n).set(countdown=7200) for n in range(3)).apply_async()
    assert _retry_after(single) == eta
    for task_id in [*in_bulk, *(r.id for r in members.results)]:
        assert _retry_after(task_id) == _eta(task_id)
    assert _retry_after(ready) is None


@pytest.fixture
def new_york() -> Iterator[tuple[OutboxCelery, celery.Celery]]:
    """An OutboxCelery and a plain Celery app, both with timezone America/New_York."""
    apps = (
        OutboxCelery("held-new-york", fixups=[], set_as_current=False),
        celery.Celery("plain-new-york", fixups=[], set_as_current=False),
    )
    for each in apps:
        each.conf.update(timezone="America/New_York", enable_utc=True)
    yield apps
    for each in apps:
        each.close()


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=60)
def test_a_naive_eta_is_held_until_it_read_as_utc_whatever_the_apps_timezone(
    new_york: tuple[OutboxCelery, celery.Celery],
) -> None:
    """A naive eta 10 min ahead in UTC is held 10 min, as the worker reads it (not 5 h 10 min
    in New York time), and its eta and expires headers are the ones plain Celery writes."""
    outbox_app, plain_app = new_york
    naive = dt.datetime.now(dt.UTC).replace(tzinfo=None) + dt.timedelta(minutes=10)
    options = {"eta": naive, "expires": naive + dt.timedelta(hours=1)}
    with transaction.atomic():
        task_id = outbox_app.send_task("tests.add", (1, 1), **options).id
    recorder = RecordingProducer()
    celery.Celery.send_task(plain_app, "tests.add", (1, 1), producer=recorder, **options)
    assert recorder.recorded is not None
    by_celery = recorder.recorded[1]["headers"]
    stored = OutboxMessage.objects.get(task_id=task_id).options["headers"]
    assert (stored["eta"], stored["expires"]) == (by_celery["eta"], by_celery["expires"])
    assert stored["eta"] == naive.isoformat()
    assert _retry_after(task_id) == naive.replace(tzinfo=dt.UTC)


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_no_claim_takes_a_held_row_before_its_eta_old_relays_included() -> None:
    """Neither this release's claim nor the released one claims a row before its ETA."""
    with transaction.atomic():
        later = add.apply_async((1, 1), countdown=3600).id
        now = add.delay(2, 2).id
    assert _claim() == [now]
    # The released relay leaves every row of this release (schema version 4) to new relays.
    assert _claim(OLD_CLAIM) == []
    assert later not in _claim() + _claim(OLD_CLAIM)


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_claim_takes_due_held_rows_first_and_locks_no_more_than_its_limit() -> None:
    """Due scheduled rows come before ready ones, and two scans lock `limit` rows in all."""
    with transaction.atomic():
        due = [add.apply_async((n, n), countdown=1).id for n in range(3)]
        ready = [add.delay(n, n).id for n in range(5)]
    time.sleep(1.1)
    with _session(autocommit=False) as first:
        taken = _claimed(first, NEW_CLAIM, 4)
        assert taken == [*due, ready[0]]
        # A second relay gets exactly the rest: the first locked only what it returned.
        assert _claim(limit=100) == ready[1:]
        first.rollback()


def test_peek_reports_the_next_held_row_for_the_relay_timer() -> None:
    """The relay's one idle query sees nothing claimable and the held row's due time."""
    with override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0), transaction.atomic():
        add.apply_async((1, 1), countdown=30)
    with _session() as conn:
        claimable, due, next_due_in = conn.execute(
            held.sql_files.queries()["peek"], {**Frontier().params(), "max_version": SCHEMA_VERSION}
        ).fetchone()
    assert (claimable, due) == (False, False)
    assert 28 < next_due_in <= 30


@pytest.fixture
def held_relay(start_relay: Any) -> Any:
    """A relay whose 60 s sweep means only its timer can publish a held row on time."""
    relay = start_relay("--sweep-interval", "60", "--stale-timeout", "120")
    wait_for(lambda: "outbox.database_connected" in relay.output(), context=relay.output)
    return relay


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=1)
def test_relay_publishes_a_held_task_at_its_eta_never_before(
    held_relay: Any, redis_queue: RedisQueue
) -> None:
    """The message reaches Redis after its ETA (not before), with Celery's eta and expires."""
    time.sleep(0.5)  # the relay is asleep, holding the wake lock
    with transaction.atomic():
        result = add.apply_async((2, 3), countdown=4, expires=600, queue=redis_queue.name)
    eta = _eta(result.id)
    stored = OutboxMessage.objects.get(task_id=result.id).options["headers"]
    seen_at = None
    deadline = time.monotonic() + 30
    while seen_at is None and time.monotonic() < deadline:
        if redis_queue.task_ids():
            seen_at = dt.datetime.now(dt.UTC)
        time.sleep(0.005)
    assert seen_at is not None, held_relay.output()
    assert seen_at >= eta
    [message] = redis_queue.messages()
    assert message["headers"]["eta"] == stored["eta"]
    assert message["headers"]["expires"] == stored["expires"]
    assert message["body"][0] == [2, 3]
    # The relay deletes the row when it commits the batch, just after the broker has it.
    wait_for(
        lambda: not OutboxMessage.objects.filter(task_id=result.id).exists(),
        what="the published row deleted",
    )


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_many_rows_due_at_once_are_all_published(held_relay: Any, redis_queue: RedisQueue) -> None:
    """A thousand rows falling due in the same instant are all published, each once."""
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    with bulk():
        ids = {add.apply_async((n, n), eta=eta, queue=redis_queue.name).id for n in range(1000)}
    wait_for(lambda: len(redis_queue.task_ids()) >= 1000, context=held_relay.output)
    assert sorted(redis_queue.task_ids()) == sorted(ids)


def _stats_json() -> dict[str, Any]:
    out = io.StringIO()
    call_command("outbox_stats", "--format", "json", stdout=out)
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_stats_show_scheduled_rows_apart_from_due_and_retrying() -> None:
    """Held rows count as scheduled, with the next due time, and do not make the outbox lag."""
    with transaction.atomic():
        add.apply_async((1, 1), countdown=3600)
        add.apply_async((1, 1), countdown=600)
        add.delay(1, 1)
    with connection.cursor() as cur:
        # A held row created a day ago is not a day late.
        cur.execute("UPDATE outbox_notify_message_v1 SET created_at = now() - interval '1 day'")
    data = _stats_json()
    assert data["scheduled"]["count"] == 2
    assert 590 < data["scheduled"]["next_due_in_seconds"] <= 600
    assert (data["queue_depth"], data["due_now"], data["retrying"]) == (3, 1, 0)
    snapshot = stats.collect(connection)
    assert "scheduled              2" in stats.format_text(snapshot)
    # Only the ready row (a day old too) is pending.
    with connection.cursor() as cur:
        cur.execute("DELETE FROM outbox_notify_message_v1 WHERE retry_after IS NULL")
    assert stats.collect(connection).oldest_pending_seconds == 0.0


@pytest.fixture
def pidbox() -> Iterator[Any]:
    """Celery's revoke broadcast as Redis delivers it: the pidbox fanout's PUBLISH channel."""
    client = redis.Redis.from_url(app.conf.broker_url)
    subscription = client.pubsub()
    subscription.psubscribe("*celery.pidbox*")
    subscription.get_message(timeout=2)  # the subscribe confirmation
    yield subscription
    subscription.close()
    client.close()


def _broadcasts(subscription: Any) -> list[Any]:
    """The bodies of the control messages broadcast since the last call."""
    found = []
    while (message := subscription.get_message(timeout=1)) is not None:
        if message["type"] == "pmessage":
            found.append(decode_envelope(message["data"])["body"])
    return found


# Celery's Redis result backend calls redis-py's deprecated setex; not ours to fix.
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_revoke_removes_a_held_task_and_still_broadcasts(pidbox: Any) -> None:
    """AsyncResult.revoke() deletes the held row, marks it REVOKED, and Celery's broadcast goes."""
    with transaction.atomic():
        result = add.apply_async((1, 1), countdown=3600)
        kept = add.apply_async((1, 1), countdown=3600)
    result.revoke()
    assert not OutboxMessage.objects.filter(task_id=result.id).exists()
    assert OutboxMessage.objects.filter(task_id=kept.id).exists()
    [broadcast] = _broadcasts(pidbox)
    assert broadcast["method"] == "revoke"
    assert broadcast["arguments"]["task_id"] == result.id
    assert app.AsyncResult(result.id).state == "REVOKED"


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_revoke_rolled_back_keeps_the_row_and_a_claimed_row_is_left_to_the_broadcast() -> None:
    """Revoke deletes in the caller's transaction; a row a relay is publishing is skipped."""
    with transaction.atomic():
        rolled = add.apply_async((1, 1), countdown=3600)
        claimed = add.apply_async((1, 1), countdown=3600)
    with pytest.raises(RuntimeError), transaction.atomic():
        rolled.revoke()
        raise RuntimeError("roll back")
    assert OutboxMessage.objects.filter(task_id=rolled.id).exists()
    with _session(autocommit=False) as relay:
        relay.execute(
            "SELECT id FROM outbox_notify_message_v1 WHERE task_id = %s FOR UPDATE",
            [claimed.id],
        )
        assert held.cancel_tasks([claimed.id], alias="default") == []
        relay.rollback()
    assert [c.task_id for c in held.cancel_tasks([claimed.id], alias="default")] == [claimed.id]


# -- the admin: the summary box, the state filter and the cancel action


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_admin_shows_scheduled_rows_and_filters_them(operator: Client) -> None:
    """The summary box counts held rows with their next due time; ?state=scheduled lists them."""
    with transaction.atomic():
        task_id = add.apply_async((1, 1), countdown=3600).id
    add_message(retries=2)  # waiting for a retry, not scheduled
    response = operator.get(reverse(OUTBOX_LIST), {"state": "scheduled"})
    summary = response.context["outbox_summary"]
    assert (summary.scheduled.count, summary.retrying) == (1, 1)
    assert "Scheduled (held until their ETA)" in response.content.decode()
    assert [row.task_id for row in response.context["cl"].result_list] == [task_id]


@override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0)
def test_admin_cancel_removes_free_rows_and_logs_each(operator: Client, relay_holds: Any) -> None:
    """Cancel deletes the selected rows no relay holds, with a LogEntry each, and says so."""
    with transaction.atomic():
        ids = [add.apply_async((n, n), countdown=3600).id for n in range(3)]
    rows = [OutboxMessage.objects.get(task_id=t) for t in ids]
    relay_holds(rows[2].id)
    response = post_action(operator, OUTBOX_LIST, "cancel", [r.id for r in rows])
    assert messages_of(response) == [
        "Cancelled 2 messages (2 held until their ETA); skipped 1 (being published by a relay "
        "right now, or already published)."
    ]
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == [ids[2]]
    assert LogEntry.objects.filter(object_id__in=[str(r.id) for r in rows[:2]]).count() == 2


def test_reset_retries_leaves_a_held_row_held(operator: Client) -> None:
    """Reset retries must not make a held row due now (that would publish it early)."""
    with override_settings(OUTBOX_NOTIFY_HOLD_ETA_AFTER=0), transaction.atomic():
        task_id = add.apply_async((1, 1), countdown=3600).id
    row = OutboxMessage.objects.get(task_id=task_id)
    post_action(operator, OUTBOX_LIST, "reset_retries", [row.id])
    assert _retry_after(task_id) == _eta(task_id)
