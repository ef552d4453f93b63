"""The faults: each one runs for about `duration` seconds while the writers keep writing.

A fault function gets the Lab (the run's servers and relays) and returns the wall-clock
window during which the system was faulty, for the latency and recovery figures.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
import redis

from chaos import poison
from chaos.processes import STALE_TIMEOUT, Process, RelayGroup, owner_of_local_port
from chaos.rabbit import ChaosRabbit
from chaos.services import PrivatePostgres, PrivateRedis
from chaos.transport import RESTORE_MUTEX_KEY

LISTEN_APP = "outbox_notify.listen"
CLAIM_APP = "outbox_notify.claim"
TERMINATE_SQL = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = %s AND datname = current_database()
"""
FREEZE_EXTRA = 3.0  # seconds a frozen relay stays stopped beyond its --stale-timeout
WORKER_RUNS = (0.5, 2.5)  # seconds a restarted worker consumes before it is killed again
WORKER_READY_TIMEOUT = 60.0  # seconds for a restarted worker to be consuming again

if TYPE_CHECKING:
    from chaos.stations import Station


@dataclasses.dataclass
class Lab:
    """What faults act on, and where they note what they did."""

    pg: PrivatePostgres
    redis: PrivateRedis | None  # the scenario's broker: one of these two
    rabbit: ChaosRabbit | None
    worker: Process | None  # the Celery worker consuming the scenario's broker
    station: Station | None  # that worker's broker station (kills and restarts it)
    relays: RelayGroup
    queue: str
    scenario: str
    rng: random.Random
    quick: bool
    events: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    poison: list[poison.Poison] = dataclasses.field(default_factory=list)
    poison_stored: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    notify_usage: list[float] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def event(self, text: str) -> None:
        with self.lock:
            self.events.append((time.time(), text))

    @property
    def broker(self) -> PrivateRedis:
        """The private redis-server (for the Redis faults)."""
        if self.redis is None:
            raise RuntimeError(f"{self.scenario} runs on RabbitMQ, not Redis")
        return self.redis

    @property
    def node(self) -> Any:
        """The private RabbitMQ node (for the RabbitMQ faults)."""
        if self.rabbit is None:
            raise RuntimeError(f"{self.scenario} runs on Redis, not RabbitMQ")
        return self.rabbit.node


Window = tuple[float, float]
Fault = Callable[[Lab, float], Window]


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def _pick(lab: Lab) -> Process:
    return lab.rng.choice(lab.relays.relays)


def kill_relays(lab: Lab, duration: float) -> Window:
    """SIGKILL a random relay every 1.5-3.5 s and start a new one in its place."""
    start = time.time()
    end = time.monotonic() + duration
    while True:
        pause = lab.rng.uniform(1.5, 3.5)
        if time.monotonic() + pause > end:
            break
        time.sleep(pause)
        relay = _pick(lab)
        lab.relays.kill_and_restart(relay)
        lab.event(f"SIGKILL {relay.name}, restarted")
    _sleep_until(end)
    return start, time.time()


def terminate(application_name: str) -> Fault:
    """A fault that ends the relays' sessions of one kind with pg_terminate_backend."""

    def fault(lab: Lab, duration: float) -> Window:
        start = time.time()
        end = time.monotonic() + duration
        while True:
            pause = lab.rng.uniform(1.0, 2.5)
            if time.monotonic() + pause > end:
                break
            time.sleep(pause)
            with lab.pg.admin() as conn:
                row = conn.execute(TERMINATE_SQL, [application_name]).fetchone()
            lab.event(f"pg_terminate_backend on {row[0] if row else 0} {application_name}")
        _sleep_until(end)
        return start, time.time()

    fault.__doc__ = f"pg_terminate_backend every 1-2.5 s on {application_name} sessions"
    return fault


def restart_postgres(lab: Lab, duration: float) -> Window:
    """Restart PostgreSQL (fast shutdown) once, and a second time in the full run."""
    start = time.time()
    end = time.monotonic() + duration
    restarts = 1 if lab.quick else 2
    for index in range(restarts):
        began = time.monotonic()
        lab.pg.restart()
        lab.event(f"PostgreSQL restarted (fast) in {time.monotonic() - began:.1f}s")
        if index < restarts - 1:
            time.sleep(max(0.0, duration / restarts - (time.monotonic() - began)))
    fault_end = time.time()
    _sleep_until(end)
    return start, fault_end


def stop_broker(lab: Lab, duration: float) -> Window:
    """Stop the private redis-server for `duration` seconds, then start it again."""
    start = time.time()
    lab.broker.stop()
    lab.event("redis stopped (SIGTERM, saving)")
    time.sleep(duration)
    lab.broker.start()
    lab.event(f"redis started ({lab.broker.opened_note}); {_restore_lock(lab)}")
    return start, time.time()


def _restore_lock(lab: Lab) -> str:
    """Whether kombu's restore lock is held (a sweep cut short by a stop or a kill leaves it
    behind until it expires: chaos.transport); a note for the scenario's events."""
    try:
        ttl_ms = int(lab.broker.client().pttl(RESTORE_MUTEX_KEY))
    except redis.RedisError as exc:
        return f"{RESTORE_MUTEX_KEY} unknown ({type(exc).__name__})"
    return (
        f"{RESTORE_MUTEX_KEY} held ({ttl_ms / 1000:.1f} s left)"
        if ttl_ms >= 0
        else f"{RESTORE_MUTEX_KEY} free"
    )


WAKE_LOCK_HOLDER_SQL = """
SELECT a.client_port FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
WHERE l.locktype = 'advisory' AND l.classid = 1869968482 AND l.objid = 1
  AND l.mode = 'ExclusiveLock' AND l.granted
"""


def _wake_lock_holder(lab: Lab) -> Process | None:
    """The relay asleep with the wake lock right now, if any."""
    with lab.pg.admin() as conn:
        row = conn.execute(WAKE_LOCK_HOLDER_SQL).fetchone()
    return owner_of_local_port(lab.relays.relays, int(row[0])) if row else None


def _freeze_wake_lock_holder(lab: Lab, patience: float = 3.0) -> Process | None:
    """Freeze the relay holding the wake lock the moment one is seen (within `patience` s)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        holder = _wake_lock_holder(lab)
        if holder is not None:
            holder.freeze()
            return holder
        time.sleep(0.05)
    return None


def freeze_broker(lab: Lab, duration: float) -> Window:
    """SIGSTOP the redis-server: connections stay open, nothing answers; then SIGCONT."""
    proc = lab.broker.proc
    if proc is None:
        raise RuntimeError("the broker is not running")
    start = time.time()
    proc.send_signal(signal.SIGSTOP)
    lab.event("redis SIGSTOPped (TCP open, no replies)")
    try:
        time.sleep(duration)
    finally:
        proc.send_signal(signal.SIGCONT)
    lab.event("redis SIGCONT")
    return start, time.time()


def refuse_writes(lab: Lab, duration: float) -> Window:
    """The broker answers but refuses every write (maxmemory reached, noeviction), then heals."""
    client = lab.broker.client()
    used = int(client.info("memory")["used_memory"])
    start = time.time()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(max(1, used // 2)))
    lab.event(f"redis maxmemory set to {used // 2} bytes (below use): writes refused with OOM")
    time.sleep(duration)
    client.config_set("maxmemory", "0")
    lab.event("redis maxmemory back to unlimited")
    return start, time.time()


def freeze_relays(lab: Lab, duration: float) -> Window:
    """SIGSTOP a relay for --stale-timeout + 3 s, then SIGCONT; each relay in turn (full run).

    The first one frozen is the relay asleep with the wake lock when there is one, to see
    whether --stale-timeout frees the lock as it frees claimed rows.
    """
    start = time.time()
    end = time.monotonic() + duration
    holder = _freeze_wake_lock_holder(lab)
    others = [r for r in lab.relays.relays if r is not holder]
    relays = ([holder] if holder else []) + others
    relays = relays[:1] if lab.quick else relays
    for relay in relays:
        if relay is not holder:
            time.sleep(lab.rng.uniform(0.2, 1.0))
            relay.freeze()
        lab.event(f"SIGSTOP {relay.name}" + (" (it held the wake lock)" if relay is holder else ""))
        time.sleep(STALE_TIMEOUT + FREEZE_EXTRA)
        relay.thaw()
        lab.event(f"SIGCONT {relay.name}")
    fault_end = time.time()
    _sleep_until(end)
    return start, fault_end


def kill_workers(lab: Lab, duration: float) -> Window:
    """SIGKILL the Celery worker (`acks_late`, tasks in hand) once it consumes, restart it;
    again and again for `duration` s. Its unacknowledged messages are delivered again."""
    station = lab.station
    if station is None:
        raise RuntimeError("no worker station to kill")
    start = time.time()
    end = time.monotonic() + duration
    while time.monotonic() < end:
        ready_by = time.monotonic() + WORKER_READY_TIMEOUT
        while not station.ready_since_start() and time.monotonic() < ready_by:
            time.sleep(0.1)
        time.sleep(lab.rng.uniform(*WORKER_RUNS))
        station.kill_and_restart()
        note = f"; {_restore_lock(lab)}" if lab.redis is not None else ""
        lab.event(f"SIGKILL the Celery worker, restarted{note}")
    return start, time.time()


def write_poison(lab: Lab, duration: float) -> Window:
    """Write the poison rows with SQL, then keep the load running for `duration`."""
    start = time.time()
    lab.poison = poison.make(lab.scenario, lab.queue)
    with lab.pg.admin() as conn:
        lab.poison_stored = poison.insert(conn, lab.poison)
    lab.event(f"{len(lab.poison)} poison rows inserted")
    time.sleep(duration)
    return start, time.time()


def notify_pressure(lab: Lab, duration: float) -> Window:
    """A session LISTENs on the outbox channel and then idles in an open transaction."""
    start = time.time()
    end = time.monotonic() + duration
    _hold_pressure(lab, lambda: time.monotonic() >= end)
    return start, time.time()


def _hold_pressure(lab: Lab, done: Callable[[], bool]) -> None:
    """Keep a LISTENing session idle in a transaction until done(); reopen it if it is cut."""
    while not done():
        try:
            with psycopg.connect(lab.pg.server.url("chaos"), autocommit=True) as conn:
                conn.execute("LISTEN outbox_notify_v1")
                conn.autocommit = False
                conn.execute("SELECT 1")  # the transaction stays open: notifications pile up
                lab.event("a LISTEN session sits in an open transaction")
                _sample_queue_usage(lab, done)
                conn.rollback()
                lab.event("the LISTEN session ended its transaction")
        except psycopg.Error as exc:
            lab.event(f"the LISTEN session was cut ({type(exc).__name__}); reopening")
            time.sleep(0.5)


def _sample_queue_usage(lab: Lab, done: Callable[[], bool]) -> None:
    with lab.pg.admin() as probe:
        while not done():
            row = probe.execute("SELECT pg_notification_queue_usage()").fetchone()
            lab.notify_usage.append(float(row[0]) if row else 0.0)
            time.sleep(0.5)


def mixed(lab: Lab, duration: float) -> Window:
    """Everything at once: kills and terminations in the background, the rest in turn."""
    start = time.time()
    stop = threading.Event()
    background = threading.Thread(target=_background_faults, args=(lab, stop), daemon=True)
    pressure = threading.Thread(target=_hold_pressure, args=(lab, stop.is_set), daemon=True)
    background.start()
    pressure.start()
    try:
        write_poison(lab, 1.0)
        steps: list[tuple[Fault, float]] = [
            (restart_postgres, 2.0),
            (freeze_relays, 1.0),
            (stop_broker, 5.0 if lab.quick else 10.0),
        ]
        lab.rng.shuffle(steps)
        for fault, seconds in steps:
            fault(lab, seconds)
            time.sleep(1.0)
    finally:
        stop.set()
        background.join(timeout=30)
        pressure.join(timeout=30)
    return start, time.time()


def _background_faults(lab: Lab, stop: threading.Event) -> None:
    actions: list[Callable[[], None]] = [
        lambda: _kill_one(lab),
        lambda: _terminate_once(lab, LISTEN_APP),
        lambda: _terminate_once(lab, CLAIM_APP),
    ]
    while not stop.wait(lab.rng.uniform(1.5, 3.0)):
        try:
            lab.rng.choice(actions)()
        except psycopg.Error as exc:
            lab.event(f"background fault skipped: {type(exc).__name__}")


def _kill_one(lab: Lab) -> None:
    relay = _pick(lab)
    lab.relays.kill_and_restart(relay)
    lab.event(f"SIGKILL {relay.name}, restarted")


def _terminate_once(lab: Lab, application_name: str) -> None:
    with lab.pg.admin() as conn:
        row = conn.execute(TERMINATE_SQL, [application_name]).fetchone()
    lab.event(f"pg_terminate_backend on {row[0] if row else 0} {application_name}")
