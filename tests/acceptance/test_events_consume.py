"""`manage.py outbox_consume` as a subprocess on RabbitMQ and Redis: once, retries, dead letters, kills.

Events are published exactly as the relay publishes them (tests/events_support.py). The
consumer is tests.event_consumers.consumer: handlers write Effect rows in their transaction and
record each run in a file outside it. Events are handled in queue order by one consumer, so
once a later "sentinel" event's effect is there, every event published before it has been
dealt with (retried copies excepted).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from outbox_notify.events import envelope as wire
from outbox_notify.events.consumer import Consumer, event_type_of
from outbox_notify.events.delivery import (
    DEAD_AT,
    DEAD_ATTEMPTS,
    DEAD_CONSUMER,
    DEAD_KIND,
    DEAD_REASON,
    LOST_SESSIONS_IN_HAND,
    ORIGINAL_EXCHANGE,
    ORIGINAL_ROUTING_KEY,
)
from outbox_notify.models import InboxRecord
from tests import event_consumers
from tests.command_support import run_command
from tests.event_consumers import OrderPlaced, runs
from tests.events_support import (
    SOURCE,
    dead_letters,
    declare,
    envelope_for,
    publish_body,
    publish_event,
    queued,
    remove,
    unique_names,
)
from tests.relay_support import ROOT, RelayProcess, wait_for
from tests.testapp.models import Effect

# transaction=True: the consumer is another process; it sees only committed rows, and the
# test sees only what it committed.
pytestmark = pytest.mark.django_db(transaction=True)

CONSUMER = "tests.event_consumers.consumer"
DEADLINE = 90.0  # seconds: generous, the machine is shared


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each test runs on both brokers."""
    fixture = "amqp_url" if request.param == "rabbitmq" else "redis_url"
    return str(request.getfixturevalue(fixture))


class Setup:
    """One test's consumer: its names, its broker, its record file, its processes."""

    def __init__(self, env: dict[str, Any], tmp_path: Path) -> None:
        self.env = env
        self.tmp_path = tmp_path
        self.url = str(env["OUTBOX_TEST_BROKER_URL"])
        self.record = Path(env["OUTBOX_TEST_RECORD_FILE"])
        self.processes: list[RelayProcess] = []
        names = {k: v for k, v in env.items() if k.startswith("OUTBOX_TEST_EVENTS_")}
        self.consumer = _consumer(names)

    def start(self) -> RelayProcess:
        return self.start_with()

    def start_with(self, *flags: str) -> RelayProcess:
        log_path = self.tmp_path / f"consume-{len(self.processes)}.log"
        process = RelayProcess("outbox_consume", [CONSUMER, *flags], self.env, log_path)
        self.processes.append(process)
        return process

    def publish(self, event: Any, event_id: str | None = None) -> wire.Envelope:
        envelope = envelope_for(event, event_id=event_id)
        publish_event(self.url, self.consumer.exchange, envelope)
        return envelope

    def sentinel(self, marker: str = "sentinel") -> None:
        """Publish a last event and wait until its effect committed (everything before is done)."""
        self.publish(OrderPlaced(order_id=0, marker=marker))
        wait_for(
            lambda: Effect.objects.filter(marker=marker).exists(),
            timeout=DEADLINE,
            what=f"the {marker} event's effect",
            context=self.logs,
        )

    def logs(self) -> str:
        return "\n".join(p.output() for p in self.processes)


def _consumer(names: dict[str, str]) -> Consumer:
    return Consumer(
        names["OUTBOX_TEST_EVENTS_NAME"],
        exchange=names["OUTBOX_TEST_EVENTS_EXCHANGE"],
        queue=names["OUTBOX_TEST_EVENTS_QUEUE"],
    )


@pytest.fixture
def make_setup(
    subprocess_env: dict[str, Any], tmp_path: Path
) -> Iterator[Callable[[str, dict[str, str]], Setup]]:
    """Build a Setup on a broker; its processes, queues and exchanges go after the test."""
    made: list[Setup] = []

    def make(url: str, extra: dict[str, str] | None = None) -> Setup:
        env = dict(subprocess_env, **unique_names(), **(extra or {}))
        env.update(OUTBOX_TEST_BROKER_URL=url, OUTBOX_TEST_RECORD_FILE=str(tmp_path / "runs.jsonl"))
        setup = Setup(env, tmp_path)
        declare(url, setup.consumer)
        made.append(setup)
        return setup

    yield make
    for setup in made:
        for process in setup.processes:
            process.stop()
        remove(setup.url, setup.consumer)


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body


def effects(marker: str) -> int:
    return Effect.objects.filter(marker=marker).count()


def test_each_event_is_handled_once_and_redeliveries_are_skipped(
    broker_url: str, make_setup: Any
) -> None:
    """20 events, one of them published three times: 20 effects, 20 inbox records."""
    setup = make_setup(broker_url)
    setup.start()
    first = setup.publish(OrderPlaced(order_id=1, marker="m0"))
    setup.publish(OrderPlaced(order_id=1, marker="m0"), event_id=first.id)
    for n in range(1, 20):
        setup.publish(OrderPlaced(order_id=n, marker=f"m{n}"))
    setup.publish(OrderPlaced(order_id=1, marker="m0"), event_id=first.id)
    setup.sentinel()
    assert all(effects(f"m{n}") == 1 for n in range(20))
    assert InboxRecord.objects.filter(scope=setup.consumer.scope).count() == 21
    assert setup.logs().count("outbox.event_duplicate_skipped") == 2
    assert dead_letters(broker_url, setup.consumer) == []


def test_one_id_from_two_sources_is_two_events_and_a_key_from_before_the_upgrade_holds(
    broker_url: str, make_setup: Any
) -> None:
    """order-42 from billing and from shipping: each handled once, redeliveries skipped; an
    event recorded by its id alone (an earlier release's key) is skipped when redelivered."""
    setup = make_setup(broker_url)
    InboxRecord.objects.create(
        scope=setup.consumer.scope,
        key="ev-before-upgrade",
        task_id="ev-before-upgrade",
        task_name=event_type_of(OrderPlaced),
    )
    setup.start()
    events = [
        ("/billing", "order-42", "billing"),
        ("/shipping", "order-42", "shipping"),
        ("/billing", "order-42", "billing"),
        (SOURCE, "ev-before-upgrade", "before-upgrade"),
        ("/shipping", "order-42", "shipping"),
    ]
    for source, event_id, marker in events:
        envelope = envelope_for(OrderPlaced(order_id=42, marker=marker), event_id=event_id)
        publish_event(broker_url, setup.consumer.exchange, replace(envelope, source=source))
    setup.sentinel()
    assert (effects("billing"), effects("shipping"), effects("before-upgrade")) == (1, 1, 0)
    assert setup.logs().count("outbox.event_duplicate_skipped") == 3
    assert dead_letters(broker_url, setup.consumer) == []


def test_a_handler_that_fails_once_is_retried_and_its_effect_committed_once(
    broker_url: str, make_setup: Any
) -> None:
    """The first run raises and rolls back; the retry (attempt 2) commits."""
    setup = make_setup(broker_url)
    setup.start()
    envelope = setup.publish(OrderPlaced(order_id=1, marker="flaky", fail_runs=1))
    wait_for(lambda: effects("flaky"), timeout=DEADLINE, what="the retry", context=setup.logs)
    assert list(Effect.objects.values_list("marker", "attempt")) == [("flaky", 1)]
    assert len(runs(setup.record, envelope.id)) == 2
    assert "outbox.event_retry_scheduled" in setup.logs()


def test_a_handler_that_keeps_failing_is_dead_lettered_with_its_reason(
    broker_url: str, make_setup: Any
) -> None:
    """max_attempts runs, each rolled back, then the unchanged message goes to the DLX."""
    setup = make_setup(broker_url)
    setup.start()
    envelope = setup.publish(OrderPlaced(order_id=1, marker="doomed", fail_runs=-1))
    [dead] = wait_for(
        lambda: dead_letters(broker_url, setup.consumer),
        timeout=DEADLINE,
        what="a dead letter",
        context=setup.logs,
    )
    assert wire.decode(dead.body) == envelope
    headers = dead.headers
    assert headers[DEAD_KIND] == "handler-failed"
    assert headers[DEAD_REASON] == (
        "handler failed 3 times; last error: RuntimeError: doomed run 3 fails on purpose"
    )
    assert headers[DEAD_ATTEMPTS] == event_consumers.MAX_ATTEMPTS
    assert headers[DEAD_CONSUMER] == setup.consumer.name
    assert headers[ORIGINAL_EXCHANGE] == setup.consumer.exchange
    assert headers[ORIGINAL_ROUTING_KEY] == envelope.type
    assert headers["cloudEvents_id"] == envelope.id
    assert headers[DEAD_AT].endswith("Z")
    assert dead.content_type == wire.CONTENT_TYPE
    assert len(runs(setup.record, envelope.id)) == event_consumers.MAX_ATTEMPTS
    assert effects("doomed") == 0
    assert not InboxRecord.objects.filter(task_id=envelope.id).exists()


def test_an_undecodable_message_is_dead_lettered_at_once_and_the_consumer_goes_on(
    broker_url: str, make_setup: Any
) -> None:
    """Bad JSON: straight to the DLX (0 attempts) with the decoder's reason; the next is handled."""
    setup = make_setup(broker_url)
    setup.start()
    publish_body(broker_url, setup.consumer.exchange, b"{broken", routing_key="tests.broken")
    setup.sentinel()
    [dead] = dead_letters(broker_url, setup.consumer)
    assert _as_bytes(dead.body) == b"{broken"  # py-amqp gives str for a UTF-8 body
    assert dead.headers[DEAD_KIND] == "undecodable"
    assert dead.headers[DEAD_ATTEMPTS] == 0
    assert dead.headers[DEAD_REASON].startswith("body is not JSON")
    assert dead.delivery_info["routing_key"] == "tests.broken"


def test_sigterm_finishes_the_handler_in_hand_then_exits_0(
    broker_url: str, make_setup: Any
) -> None:
    """Graceful stop: the running handler commits, its message is acked, nothing runs twice."""
    setup = make_setup(broker_url)
    process = setup.start()
    envelope = setup.publish(OrderPlaced(order_id=1, marker="slow", sleep=4.0))
    wait_for(lambda: runs(setup.record, envelope.id), timeout=DEADLINE, context=setup.logs)
    process.signal(signal.SIGTERM)
    assert process.wait(DEADLINE) == 0, setup.logs()
    assert effects("slow") == 1
    assert queued(broker_url, setup.consumer.queue) == 0
    assert len(runs(setup.record, envelope.id)) == 1


def _holding_inbox_row(event_id: str) -> bool:
    """Whether some session holds an uncommitted inbox insert (the handler is mid-transaction)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle in transaction' AND query LIKE %s",
            ["%testapp_effect%"],
        )
        return bool(cursor.fetchone()[0])


@pytest.fixture(params=["rabbitmq", "redis"])
def crash_broker(request: pytest.FixtureRequest) -> dict[str, str]:
    """RabbitMQ (redelivers at once), or a private Redis with a 2 s visibility timeout."""
    if request.param == "rabbitmq":
        return {"OUTBOX_TEST_BROKER_URL": str(request.getfixturevalue("amqp_url"))}
    # A private Redis: the short visibility timeout restores every unacknowledged message of
    # its database, which must not be other tests' messages.
    private = request.getfixturevalue("private_redis")
    return {"OUTBOX_TEST_BROKER_URL": private.url(), "OUTBOX_TEST_VISIBILITY_TIMEOUT": "2"}


def test_a_consumer_killed_mid_handler_is_restarted_and_the_effect_applied_once(
    crash_broker: dict[str, str], make_setup: Any
) -> None:
    """SIGKILL inside the handler's transaction: it rolls back; the redelivery commits once."""
    setup = make_setup(crash_broker["OUTBOX_TEST_BROKER_URL"], crash_broker)
    doomed = setup.start()
    envelope = setup.publish(OrderPlaced(order_id=1, marker="crash", sleep=120.0))
    wait_for(
        lambda: _holding_inbox_row(envelope.id),
        timeout=DEADLINE,
        what="the handler to hold its transaction open",
        context=setup.logs,
    )
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    setup.start()
    wait_for(lambda: effects("crash"), timeout=DEADLINE, what="the redelivery", context=setup.logs)
    setup.sentinel()
    assert effects("crash") == 1
    assert len(runs(setup.record, envelope.id)) == 2
    assert InboxRecord.objects.filter(task_id=envelope.id).count() == 1


def test_the_consumer_reconnects_after_a_broker_outage(private_redis: Any, make_setup: Any) -> None:
    """Redis goes away and comes back: the consumer reconnects and handles what comes next."""
    setup = make_setup(private_redis.url())
    setup.start()
    setup.sentinel("before")
    private_redis.stop()
    wait_for(
        lambda: "outbox.consumer_broker_unavailable" in setup.logs(),
        timeout=DEADLINE,
        what="the outage to be seen",
    )
    private_redis.start()
    declare(setup.url, setup.consumer)  # a restarted private Redis keeps nothing
    setup.sentinel("after")


def _terminate_other_sessions() -> int:
    """End every other session on the test database (the consumer's included); how many."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_a_lost_database_connection_spends_no_attempt(broker_url: str, make_setup: Any) -> None:
    """The consumer's session is terminated: it reconnects and handles the event, no retry."""
    setup = make_setup(broker_url)
    setup.start()
    setup.sentinel("before")
    assert _terminate_other_sessions() >= 1
    envelope = setup.publish(OrderPlaced(order_id=1, marker="after-outage"))
    setup.sentinel("after")
    assert effects("after-outage") == 1, setup.logs()
    assert len(runs(setup.record, envelope.id)) == 1
    assert "outbox.consumer_database_unavailable" in setup.logs()
    assert "outbox.event_retry_scheduled" not in setup.logs()


def test_a_handler_that_keeps_losing_its_session_is_dead_lettered_not_held_forever(
    broker_url: str, make_setup: Any
) -> None:
    """The database answers, the handler's own session dies each run: attempts are spent."""
    setup = make_setup(broker_url)
    setup.start_with("--outage-cooldown", "0.1")
    envelope = wire.Envelope(
        id="self-terminate", source="/tests", type="tests.self_terminate",
        time=envelope_for(OrderPlaced(order_id=0, marker="t")).time, data={},
    )  # fmt: skip
    publish_event(broker_url, setup.consumer.exchange, envelope)
    [dead] = wait_for(
        lambda: dead_letters(broker_url, setup.consumer),
        timeout=DEADLINE,
        what="a dead letter",
        context=setup.logs,
    )
    assert dead.headers[DEAD_KIND] == "handler-failed"
    assert dead.headers[DEAD_ATTEMPTS] == event_consumers.MAX_ATTEMPTS
    runs_made = len(runs(setup.record, envelope.id))
    assert runs_made == event_consumers.MAX_ATTEMPTS * LOST_SESSIONS_IN_HAND, setup.logs()


def test_prefetch_limits_what_the_broker_hands_over(amqp_url: str, make_setup: Any) -> None:
    """RabbitMQ: with prefetch 2 and the first handler busy, the rest stays ready in the queue."""
    setup = make_setup(amqp_url, {"OUTBOX_TEST_EVENTS_PREFETCH": "2"})
    setup.start()
    slow = setup.publish(OrderPlaced(order_id=1, marker="slow", sleep=10.0))
    for n in range(10):
        setup.publish(OrderPlaced(order_id=n + 2, marker=f"later-{n}"))
    wait_for(
        lambda: runs(setup.record, slow.id),
        timeout=DEADLINE,
        what="the slow run",
        context=setup.logs,
    )
    # The slow one is in hand, one more is prefetched: 9 of 11 must still be ready.
    assert wait_for(
        lambda: queued(amqp_url, setup.consumer.queue) == 9,
        timeout=DEADLINE,
        what="9 ready messages",
        context=setup.logs,
    )


def _command(env: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", "outbox_consume", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("path", "broker", "error"),
    [
        ("tests.event_consumers.nothing", None, "cannot import consumer"),
        (
            "tests.event_consumers.build",
            None,
            "is a function, not an outbox_notify.events.Consumer",
        ),
        (CONSUMER, "redis://127.0.0.1:1/0", "the broker cannot be reached"),
    ],
)
def test_start_up_errors_are_one_line(
    subprocess_env: dict[str, Any], redis_url: str, path: str, broker: str | None, error: str
) -> None:
    """A wrong path or an unreachable broker: exit 1 with one CommandError line."""
    env = dict(subprocess_env, OUTBOX_TEST_BROKER_URL=broker or redis_url)
    done = _command(env, path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("CommandError: ")
    assert error in lines[0]


# -- outbox_consume_dead: list the dead letters, replay them -----------------------------------


def _dead_command(setup: Setup, *args: str) -> Any:
    return run_command(setup.env, "outbox_consume_dead", CONSUMER, *args)


def test_dead_letters_are_listed_without_removing_them_and_replayed_by_id(
    broker_url: str, make_setup: Any
) -> None:
    """--list shows each dead letter (id, kind, reason, redacted data) and leaves it queued;
    --replay --id sends that one back to the consumer, which handles it; the other stays."""
    setup = make_setup(broker_url)
    consumer = setup.start()
    # Fails its 3 attempts, then succeeds on its 4th run: the replay.
    doomed = setup.publish(
        OrderPlaced(order_id=7, marker="replayed", fail_runs=event_consumers.MAX_ATTEMPTS)
    )
    publish_body(broker_url, setup.consumer.exchange, b"{broken", routing_key="tests.broken")
    wait_for(
        lambda: queued(broker_url, setup.consumer.dead_letter_exchange) == 2,
        timeout=DEADLINE,
        what="two dead letters",
        context=setup.logs,
    )
    listed = _dead_command(setup, "--list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    by_kind = {d["kind"]: d for d in json.loads(listed.stdout)}
    assert by_kind["handler-failed"]["event_id"] == doomed.id
    assert by_kind["handler-failed"]["attempts"] == event_consumers.MAX_ATTEMPTS
    assert "fails on purpose" in by_kind["handler-failed"]["reason"]
    assert '"order_id": 7' in by_kind["handler-failed"]["data"]
    assert by_kind["undecodable"]["event_id"] is None
    assert by_kind["undecodable"]["data"] == "<not JSON>"
    assert queued(broker_url, setup.consumer.dead_letter_exchange) == 2  # nothing removed
    table = _dead_command(setup, "--list")
    assert doomed.id in table.stdout

    replayed = _dead_command(setup, "--replay", "--id", doomed.id, "missing-id")
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == f"replayed 1 dead letters to queue '{setup.consumer.queue}'"
    assert "1 of the given ids were not found: missing-id" in replayed.stderr
    wait_for(
        lambda: InboxRecord.objects.filter(key=doomed.id).exists(),
        timeout=DEADLINE,
        what="the replayed event handled",
        context=setup.logs,
    )
    assert len(runs(setup.record, doomed.id)) == event_consumers.MAX_ATTEMPTS + 1
    [left] = dead_letters(broker_url, setup.consumer)
    assert _as_bytes(left.body) == b"{broken"
    assert consumer.proc.poll() is None


def test_replay_without_ids_sends_back_every_dead_letter(broker_url: str, make_setup: Any) -> None:
    """--replay alone empties the dead-letter queue into the consumer's queue, headers reset."""
    setup = make_setup(broker_url)
    envelopes = [
        setup.publish(OrderPlaced(order_id=i, marker=f"all-{i}", fail_runs=-1)) for i in (1, 2)
    ]
    # No consumer runs: dead-letter them by hand, as the consumer would.
    taken = queued(broker_url, setup.consumer.queue)
    assert taken == 2
    for envelope in envelopes:
        publish_body(
            broker_url,
            setup.consumer.dead_letter_exchange,
            wire.encode(envelope),
            routing_key=envelope.type,
            headers={DEAD_KIND: "handler-failed", DEAD_ATTEMPTS: 3, DEAD_REASON: "boom"},
        )
    ran = _dead_command(setup, "--replay")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("replayed 2 dead letters")
    assert queued(broker_url, setup.consumer.dead_letter_exchange) == 0
    assert queued(broker_url, setup.consumer.queue) == 4


def test_consume_dead_says_in_one_line_when_the_broker_cannot_be_reached(
    subprocess_env: dict[str, Any],
) -> None:
    """An unreachable broker is exit 1 and one line, nothing on stdout."""
    env = dict(subprocess_env, **unique_names(), OUTBOX_TEST_BROKER_URL="redis://127.0.0.1:1/0")
    ran = run_command(env, "outbox_consume_dead", CONSUMER, "--list")
    assert ran.returncode == 1, ran.stderr
    assert ran.stdout == ""
    [line] = ran.stderr.splitlines()
    assert line.startswith("CommandError: the broker cannot be reached"), line
