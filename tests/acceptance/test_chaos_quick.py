"""The chaos suite's quick mode as a CI test: faults under load lose nothing, run nothing rolled
back, and with OnceTask apply every committed task's effect exactly once.

`python -m chaos.run --quick --json PATH` starts its own PostgreSQL, redis-server and RabbitMQ
node, two relays and a real Celery worker per broker, and injects relay kills,
pg_terminate_backend on both relay sessions, a Redis stop, SIGKILLs of the worker (acks_late)
on both brokers, poison rows, a RabbitMQ stop, RabbitMQ closing every connection, a memory
alarm, a queue at its length limit and a frozen node, while 16 writers commit and roll back
(docs/reliability.md). The workers' task is an OnceTask whose body writes one effect row.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
QUICK_SCENARIOS = [
    "kill",
    "terminate_listen",
    "terminate_claim",
    "broker_stop",
    "worker_kill",
    "poison",
    "rabbit_stop",
    "rabbit_connections",
    "rabbit_worker_kill",
    "rabbit_memory_alarm",
    "rabbit_queue_limit",
    "rabbit_freeze",
]
RUN_TIMEOUT = 900  # seconds: the quick run takes 4-5 min; a loaded CI machine gets slack

pytestmark = [pytest.mark.worker, pytest.mark.timeout(RUN_TIMEOUT + 60)]


@pytest.fixture(scope="module")
def chaos_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the quick chaos suite once; its JSON results (the log folder is kept under tmp)."""
    from devtools import rabbitserver

    for name, found in (
        ("redis-server", shutil.which("redis-server") is not None),
        ("rabbitmq-server", rabbitserver.installed()),
    ):
        if not found:
            if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
                pytest.fail(f"{name} is not installed; CI requires it")
            pytest.skip(f"{name} is not installed")
    base = tmp_path_factory.mktemp("chaos")
    out = base / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "chaos.run", "--quick", "--json", str(out),
         "--log-dir", str(base / "logs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert out.exists(), f"no results written\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
    results: dict[str, Any] = json.loads(out.read_text())
    results["stdout"] = done.stdout
    return results


def _scenarios(results: dict[str, Any]) -> list[dict[str, Any]]:
    return list(results["scenarios"])


def test_quick_run_covers_its_scenarios_under_load(chaos_results: dict[str, Any]) -> None:
    """Every quick scenario ran, and writers committed and rolled back in each."""
    scenarios = _scenarios(chaos_results)
    assert [s["scenario"] for s in scenarios] == QUICK_SCENARIOS, chaos_results["stdout"]
    for scenario in scenarios:
        assert scenario["committed"] > 0, scenario["scenario"]
        assert scenario["rolled_back"] > 0, scenario["scenario"]


def test_no_committed_message_is_lost(chaos_results: dict[str, Any]) -> None:
    """Under every fault, each committed message reached the broker: none lost, none given up."""
    lost = {s["scenario"]: (s["lost"], s["dead_lettered"]) for s in _scenarios(chaos_results)}
    assert lost == dict.fromkeys(QUICK_SCENARIOS, (0, 0)), chaos_results["stdout"]


def test_broker_faults_spend_no_retry(chaos_results: dict[str, Any]) -> None:
    """No committed message's publish was counted as failed: every broker fault was an outage."""
    spent = {s["scenario"]: s["retries_spent"] for s in _scenarios(chaos_results)}
    assert spent == dict.fromkeys(QUICK_SCENARIOS, 0), chaos_results["stdout"]


def test_every_effect_is_applied_exactly_once(chaos_results: dict[str, Any]) -> None:
    """OnceTask: each committed task a worker received took effect once, duplicates or not."""
    effects = {
        s["scenario"]: (s["effects_applied"], s["effects_missing"], s["effects_twice"])
        for s in _scenarios(chaos_results)
    }
    expected = {
        s["scenario"]: (s["committed"] - s["lost_after_broker"], 0, 0)
        for s in _scenarios(chaos_results)
    }
    assert effects == expected, chaos_results["stdout"]
    assert all(s["effects_unexpected"] == 0 for s in _scenarios(chaos_results))


def test_the_worker_was_killed_mid_run_on_both_brokers(chaos_results: dict[str, Any]) -> None:
    """The worker-kill scenarios SIGKILLed their worker while it consumed, and nothing else did."""
    kills = {s["scenario"]: s["worker_kills"] > 0 for s in _scenarios(chaos_results)}
    expected = {name: name.endswith("worker_kill") for name in QUICK_SCENARIOS}
    assert kills == expected, chaos_results["stdout"]


def test_every_duplicate_is_traced_to_its_source(chaos_results: dict[str, Any]) -> None:
    """Each task run twice was either published twice or redelivered by its broker."""
    untraced = {
        s["scenario"]: {"sample": s["duplicates_untraced_sample"], "events": s["events"]}
        for s in _scenarios(chaos_results)
        if s["duplicates_untraced"]
    }
    assert untraced == {}, chaos_results["stdout"][-3000:]


def test_rabbitmq_scenarios_ran_on_rabbitmq(chaos_results: dict[str, Any]) -> None:
    """The RabbitMQ scenarios published to the private node, whose firehose saw their messages."""
    for scenario in _scenarios(chaos_results):
        expected = "rabbitmq" if scenario["scenario"].startswith("rabbit_") else "redis"
        assert scenario["broker"] == expected, scenario["scenario"]
        assert scenario["committed_seen_by_broker"] > 0, scenario["scenario"]


def test_no_rolled_back_message_is_executed(chaos_results: dict[str, Any]) -> None:
    """Under every fault, no message of a rolled-back transaction was published or executed."""
    for scenario in _scenarios(chaos_results):
        assert scenario["rolled_back_executed"] == 0, chaos_results["stdout"]
        assert scenario["rolled_back_published"] == 0, chaos_results["stdout"]


def test_poison_rows_end_as_documented(chaos_results: dict[str, Any]) -> None:
    """Undecodable rows are dead-lettered, a future schema is kept, an unknown task published."""
    [poison] = [s for s in _scenarios(chaos_results) if s["scenario"] == "poison"]
    assert {v["kind"]: v["ok"] for v in poison["poison"]} == {
        "options-missing-headers": True,
        "options-not-object": True,
        "unknown-serializer": True,
        "future-schema": True,
        "unknown-task": True,
    }, poison["poison"]


REDELIVERY_BOUND = 40.0  # seconds: well inside a quick scenario's 60 s drain


def test_a_restore_lock_left_behind_delays_redelivery_by_seconds(private_redis: Any) -> None:
    """kombu restores a dead worker's unacknowledged Redis messages in sweeps that hold the
    lock `unacked_mutex`; a holder that dies mid-sweep (a worker SIGKILLed, or Redis stopped
    between the lock's SET and its release and restarted with the key saved) leaves it until
    it expires. With kombu's default expiry (300 s) the messages stayed unacknowledged through
    broker_stop, worker_kill and poison ("did not drain"); with the chaos worker's transport
    options a message taken by a worker that then died comes back within seconds."""
    from kombu import Connection

    from chaos.transport import VISIBILITY_TIMEOUT, redis_options

    url = private_redis.url()
    with Connection(url, transport_options=redis_options()) as dead:
        queue = dead.SimpleQueue("chaos-restore-lock")
        queue.put({"n": 1})
        taken = queue.get(timeout=5)  # now in kombu's unacknowledged set, never acknowledged
        channel = dead.default_channel
        channel.do_restore = False  # dies without putting it back, as a SIGKILLed worker does
        # The lock exactly as kombu's sweep takes it, never released: its holder died.
        lock = channel.client.lock(channel.unacked_mutex_key, timeout=channel.unacked_mutex_expire)
        assert lock.acquire(blocking=False)
        queue.close()
    began = time.monotonic()
    with Connection(url, transport_options=redis_options()) as alive:
        queue = alive.SimpleQueue("chaos-restore-lock")
        again = _get_within(queue, REDELIVERY_BOUND)
        waited = time.monotonic() - began
        again.ack()
        queue.close()
    assert again.payload == taken.payload == {"n": 1}
    assert VISIBILITY_TIMEOUT - 1 < waited < REDELIVERY_BOUND, waited


def _get_within(queue: Any, seconds: float) -> Any:
    """The next message, polling in short waits: without an event loop kombu sweeps only
    after a poll that timed out, and a wait longer than its 1 s BRPOP never times out."""
    from kombu.simple import SimpleQueue

    deadline = time.monotonic() + seconds
    while True:
        try:
            return queue.get(timeout=0.5)
        except SimpleQueue.Empty:
            if time.monotonic() > deadline:
                raise
