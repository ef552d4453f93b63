"""The scenario list: each fault on its own, then all of them mixed; then the RabbitMQ ones."""

from __future__ import annotations

import dataclasses

from chaos import faults, rabbit_faults
from chaos.queues import CAPPED_QUEUE, DEFAULT_QUEUE
from chaos.sites import RABBITMQ, REDIS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """One fault under load, with its fault duration in the full and the quick run."""

    name: str
    what: str
    fault: faults.Fault
    seconds: float
    quick_seconds: float | None  # None: not part of --quick
    broker: str = REDIS  # the broker the relays publish to and the worker consumes
    queue: str = DEFAULT_QUEUE  # the queue the writers' tasks are routed to


SCENARIOS = (
    Scenario(name="kill", what="a relay SIGKILLed every 1.5-3.5 s and restarted",
             fault=faults.kill_relays, seconds=20.0, quick_seconds=5.0),
    Scenario(name="terminate_listen",
             what="pg_terminate_backend on the relays' LISTEN sessions every 1-2.5 s",
             fault=faults.terminate(faults.LISTEN_APP), seconds=15.0, quick_seconds=4.0),
    Scenario(name="terminate_claim",
             what="pg_terminate_backend on the relays' claim sessions every 1-2.5 s",
             fault=faults.terminate(faults.CLAIM_APP), seconds=15.0, quick_seconds=4.0),
    Scenario(name="pg_restart", what="PostgreSQL restarted (fast shutdown) mid-run, twice",
             fault=faults.restart_postgres, seconds=12.0, quick_seconds=None),
    Scenario(name="broker_stop", what="redis-server stopped, then started again",
             fault=faults.stop_broker, seconds=30.0, quick_seconds=5.0),
    Scenario(name="broker_freeze",
             what="redis-server SIGSTOPped (connections open, no replies), then SIGCONT",
             fault=faults.freeze_broker, seconds=10.0, quick_seconds=None),
    Scenario(name="broker_oom",
             what="redis refuses writes (OOM: maxmemory below use, noeviction), then heals",
             fault=faults.refuse_writes, seconds=10.0, quick_seconds=None),
    Scenario(name="freeze",
             what="each relay in turn SIGSTOPped for --stale-timeout + 3 s, then SIGCONT",
             fault=faults.freeze_relays, seconds=18.0, quick_seconds=None),
    Scenario(name="worker_kill",
             what="the Celery worker (acks_late) SIGKILLed 0.5-2.5 s after it is consuming, "
             "and restarted",
             fault=faults.kill_workers, seconds=20.0, quick_seconds=6.0),
    Scenario(name="poison", what="poison rows written into the outbox with SQL",
             fault=faults.write_poison, seconds=8.0, quick_seconds=4.0),
    Scenario(name="notify_pressure",
             what="a session LISTENing on outbox_notify_v1 idles in an open transaction",
             fault=faults.notify_pressure, seconds=15.0, quick_seconds=None),
    Scenario(name="mixed",
             what="kills and terminations in the background; poison, PostgreSQL restart, "
             "freeze and a 10 s broker stop in turn; a LISTEN session idle in a transaction",
             fault=faults.mixed, seconds=0.0, quick_seconds=None),
    Scenario(name="rabbit_stop",
             what="RabbitMQ stopped (rabbitmqctl stop), then started again with its data",
             fault=rabbit_faults.stop_broker, seconds=20.0, quick_seconds=3.0, broker=RABBITMQ),
    Scenario(name="rabbit_connections",
             what="rabbitmqctl close_all_connections every 1.5-3 s (relays and worker)",
             fault=rabbit_faults.close_connections, seconds=15.0, quick_seconds=4.0,
             broker=RABBITMQ),
    Scenario(name="rabbit_worker_kill",
             what="the Celery worker (acks_late) SIGKILLed 0.5-2.5 s after it is consuming, "
             "and restarted",
             fault=faults.kill_workers, seconds=20.0, quick_seconds=6.0, broker=RABBITMQ),
    Scenario(name="rabbit_memory_alarm",
             what="RabbitMQ memory alarm (publishers blocked), then cleared",
             fault=rabbit_faults.memory_alarm, seconds=20.0, quick_seconds=8.0,
             broker=RABBITMQ),
    Scenario(name="rabbit_queue_limit",
             what="worker paused; the task queue fills to x-max-length and RabbitMQ "
             "refuses publishes (x-overflow reject-publish: nacks), then resumed",
             fault=rabbit_faults.queue_limit, seconds=10.0, quick_seconds=6.0,
             broker=RABBITMQ, queue=CAPPED_QUEUE),
    Scenario(name="rabbit_freeze",
             what="RabbitMQ SIGSTOPped (connections open, no replies), then SIGCONT",
             fault=rabbit_faults.freeze_broker, seconds=10.0, quick_seconds=6.0,
             broker=RABBITMQ),
)  # fmt: skip


def plan(*, quick: bool, only: list[str] | None) -> list[Scenario]:
    """The scenarios of this run, in order."""
    chosen = [s for s in SCENARIOS if not quick or s.quick_seconds is not None]
    if only:
        unknown = set(only) - {s.name for s in SCENARIOS}
        if unknown:
            raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}")
        chosen = [s for s in SCENARIOS if s.name in only]
    return chosen
