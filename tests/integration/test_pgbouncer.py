"""The application and the relay behind a real PgBouncer, as docs/deploy.md#pgbouncer describes.

Each test starts its own pgbouncer processes in front of the test server (transaction pooling
with a pool of two, so one client's transactions really move between server connections) and
stops them afterwards. Enqueueing runs in a subprocess whose database alias goes through the
pooler, as a web process behind PgBouncer would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from devtools import pgbouncer
from outbox_notify.models import InboxRecord, OutboxMessage
from outbox_notify.relay.config import LISTEN_APPLICATION_NAME
from tests.conftest import IN_CI
from tests.integration.test_relay import ready
from tests.relay_support import RedisQueue, run_python, wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)
# transaction=True: the relay and the enqueueing process are other processes, connected
# through the pooler; they see only committed rows.

ENQUEUE = """
import json, sys
import django
django.setup()
from django.db import transaction
from tests.celery_app import add

committed = []
for n in range(int(sys.argv[1])):
    try:
        with transaction.atomic():
            result = add.apply_async((n, n))
            if n % 4 == 3:
                raise RuntimeError("rolled back on purpose")
        committed.append(result.id)
    except RuntimeError:
        pass
print(json.dumps(committed))
"""

# OnceTask deliveries (run eagerly, through Celery's tracer) behind the pooler: each first
# delivery runs, each duplicate is skipped, a failing body rolls back with its key. BEGIN and
# the key insert travel as one simple query, which the pooler must keep on one server
# connection with the body's statements and the COMMIT.
ONCE_DELIVERIES = """
import json, uuid
import django
django.setup()
from tests.once_tasks import effect

states = []
for n in range(int(__import__("sys").argv[1])):
    task_id = str(uuid.uuid4())
    states.append(effect.apply(("pooled",), task_id=task_id).state)
    states.append(effect.apply(("pooled again",), task_id=task_id).state)
    states.append(effect.apply(("pooled fails",), {"fail": True}, task_id=task_id + "-f").state)
print(json.dumps(states))
"""


def _require_pgbouncer() -> None:
    if pgbouncer.find_pgbouncer() is not None:
        return
    if IN_CI:
        pytest.fail(
            "pgbouncer is not installed; CI requires it (Debian: apt-get install pgbouncer)"
        )
    pytest.skip("pgbouncer is not installed")


@pytest.fixture
def transaction_pooler(pg_server_url: str) -> Iterator[pgbouncer.PrivateBouncer]:
    """A private PgBouncer in transaction mode in front of the test server."""
    _require_pgbouncer()
    with pgbouncer.running(pg_server_url, pool_mode="transaction", pool_size=2) as bouncer:
        yield bouncer


@pytest.fixture
def session_pooler(pg_server_url: str) -> Iterator[pgbouncer.PrivateBouncer]:
    """A private PgBouncer in session mode, for the relay's LISTEN connection."""
    _require_pgbouncer()
    with pgbouncer.running(pg_server_url, pool_mode="session", pool_size=4) as bouncer:
        yield bouncer


def _database() -> str:
    return str(connection.settings_dict["NAME"])


def _pooled_env(relay_env: dict[str, Any], bouncer: pgbouncer.PrivateBouncer) -> dict[str, Any]:
    """The relay's environment with the database alias going through `bouncer`."""
    env = dict(relay_env)
    env["OUTBOX_TEST_DATABASE_URL"] = bouncer.url("postgres")
    return env


def _enqueue_through(env: dict[str, Any], count: int) -> list[str]:
    """Commit `count` tasks (every fourth rolled back) from a process behind the pooler."""
    committed: list[str] = json.loads(run_python(ENQUEUE, env, str(count)))
    return committed


def test_relay_behind_a_transaction_pooler_falls_back_to_polling(
    transaction_pooler: pgbouncer.PrivateBouncer,  # first: torn down after the relays
    start_relay: Any,
    redis_queue: RedisQueue,
    relay_env: dict[str, Any],
) -> None:
    """Without a LISTEN DSN the probe notices the pooler; polling still publishes it all."""
    env = _pooled_env(relay_env, transaction_pooler)
    relay = start_relay("--sweep-interval", "0.5", env=env)
    wait_for(
        lambda: "outbox.listen_unavailable" in relay.output(),
        what="the relay to notice that LISTEN does not work through the pooler",
        context=lambda: relay.output() + transaction_pooler.log()[-2000:],
    )
    ready(relay)
    committed = _enqueue_through(env, 40)
    assert len(committed) == 30
    wait_for(
        lambda: sorted(redis_queue.task_ids()) == sorted(committed),
        what="every committed task in Redis, and only those",
        context=lambda: f"{len(redis_queue.task_ids())} in Redis\n{relay.output()}",
    )
    assert not OutboxMessage.objects.exists()
    assert "Traceback" not in relay.output()


def test_listen_dsn_keeps_the_relay_event_driven_behind_a_pooler(
    transaction_pooler: pgbouncer.PrivateBouncer,  # first: torn down after the relays
    session_pooler: pgbouncer.PrivateBouncer,
    start_relay: Any,
    redis_queue: RedisQueue,
    relay_env: dict[str, Any],
) -> None:
    """Claims through the transaction pool, LISTEN through a session pool: woken by NOTIFY."""
    env = _pooled_env(relay_env, transaction_pooler)
    env["OUTBOX_TEST_LISTEN_DSN"] = session_pooler.url(_database())
    # A 60 s sweep: only a notification can explain a publish within seconds.
    relay = start_relay("--sweep-interval", "60", "--stale-timeout", "120", env=env)
    ready(relay)
    wait_for(
        _wake_lock_held_by_listen_connection,
        what="the relay asleep with the wake lock",
        context=relay.output,
    )
    committed = _enqueue_through(env, 8)
    wait_for(
        lambda: sorted(redis_queue.task_ids()) == sorted(committed),
        timeout=20,  # a third of the sweep interval
        what="the committed tasks, woken by NOTIFY",
        context=relay.output,
    )
    output = relay.output()
    assert "outbox.listen_unavailable" not in output
    assert "Traceback" not in output


def _wake_lock_held_by_listen_connection() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.classid = 1869968482 AND l.objid = 1"
            " AND l.objsubid = 2 AND l.granted AND l.mode = 'ExclusiveLock'"
            " AND a.datname = current_database()"
        )
        return [row[0] for row in cursor.fetchall()] == [LISTEN_APPLICATION_NAME]


def test_once_task_deliveries_behind_a_transaction_pooler(
    transaction_pooler: pgbouncer.PrivateBouncer, subprocess_env: dict[str, Any]
) -> None:
    """OnceTask's key and body stay in one transaction on one server connection."""
    env = _pooled_env(subprocess_env, transaction_pooler)
    states = json.loads(run_python(ONCE_DELIVERIES, env, "12"))
    assert states == ["SUCCESS", "IGNORED", "FAILURE"] * 12
    assert sorted(Effect.objects.values_list("marker", flat=True)) == ["pooled"] * 12
    assert InboxRecord.objects.count() == 12
    # Each key committed in the very transaction of its body's effect.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM outbox_notify_inbox_v1 AS i"
            " JOIN testapp_effect AS e ON e.task_id = i.task_id AND e.xmin = i.xmin"
        )
        assert cursor.fetchone()[0] == 12
