"""Runs one scenario end to end: relays, load, fault, drain, probes, accounting."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos import accounting, faults, poison
from chaos.ledger import journal
from chaos.load import LoadGenerator, Tally
from chaos.processes import RelayGroup
from chaos.queues import CAPPED_QUEUE, DEFAULT_QUEUE
from chaos.sampler import OutboxSampler
from chaos.scenarios import Scenario
from chaos.services import PrivatePostgres, Servers
from chaos.sites import RABBITMQ, RabbitSite, RedisSite
from chaos.stations import Station, environment

RELAYS = 2
READY_TIMEOUT = 60.0  # seconds for a relay or the worker to come up
PROBE_MESSAGES = 5
PROBE_TIMEOUT = 20.0  # seconds for one relay alone to get the probe messages executed
HEAL_INTERVAL = 0.5  # seconds between checks for relays that exited on their own
# Scenarios whose faults open a documented duplicate window (docs/reliability.md).
DUPLICATE_WINDOWS = {
    "kill", "terminate_listen", "terminate_claim", "pg_restart", "broker_stop", "broker_freeze",
    "broker_oom", "freeze", "mixed", "rabbit_stop", "rabbit_connections", "rabbit_memory_alarm",
    "rabbit_freeze",
}  # fmt: skip
LOG_EVENTS = (
    "outbox.database_unavailable",
    "outbox.broker_unavailable",
    "outbox.breaker_opened",
    "outbox.publish_failed",
    "outbox.dead_lettered",
    "outbox.listen_unavailable",
    "Traceback",
)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


class Supervisor(threading.Thread):
    """Restarts relays and workers when they exit on their own (each exit is recorded)."""

    def __init__(self, relays: RelayGroup, heal_worker: Callable[[], None]) -> None:
        super().__init__(name="supervisor", daemon=True)
        self.relays = relays
        self.heal_worker = heal_worker
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(HEAL_INTERVAL):
            self.relays.heal()
            self.heal_worker()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


def _station(kind: str, pg: PrivatePostgres, servers: Servers, log_dir: Path) -> Station:
    """The worker, watch and environment of one broker of the run."""
    pair: tuple[Any, Any]
    if kind == RABBITMQ:
        site: Any = RabbitSite(servers.rabbit)
        queues, pair = [DEFAULT_QUEUE, CAPPED_QUEUE], (None, servers.rabbit)
    else:
        site = RedisSite(servers.redis, DEFAULT_QUEUE)
        queues, pair = [DEFAULT_QUEUE], (servers.redis, None)
    env = environment(pg.url, site.url(), DEFAULT_QUEUE)
    return Station(site, env, log_dir, queues, servers=pair)


class Harness:
    """The run's servers, workers and environment; runs scenarios one after another."""

    def __init__(
        self,
        pg: PrivatePostgres,
        servers: Servers,
        log_dir: Path,
        *,
        timing: Any,
        quick: bool,
        brokers: set[str],
    ) -> None:
        self.pg = pg
        self.log_dir = log_dir
        self.timing = timing
        self.quick = quick
        self.stations = {
            kind: _station(kind, pg, servers, log_dir) for kind in sorted(brokers, reverse=True)
        }
        self.sampler = OutboxSampler(self.pg.admin, lambda: 0)

    def prepare(self) -> None:
        """Configure Django in this process, migrate, and start each broker's worker."""
        env = next(iter(self.stations.values())).env
        for key in ("DJANGO_SETTINGS_MODULE", "CHAOS_DATABASE_URL", "CHAOS_BROKER_URL"):
            os.environ[key] = env[key]
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        # One write outside any scenario, so Celery and Django finish their lazy set-up here
        # and not in the first scenario's warm-up.
        LoadGenerator("warmup", DEFAULT_QUEUE, rate=1.0, seed=0, writers=1).write_one(rollback=True)
        for station in self.stations.values():
            station.start()

    def heal_workers(self) -> None:
        for station in self.stations.values():
            station.heal()

    def close(self) -> None:
        for station in self.stations.values():
            station.close()

    # -- one scenario ----------------------------------------------------------------------

    def run(self, scenario: Scenario, rng: random.Random) -> dict[str, Any]:
        """Run one scenario and return its figures and verdicts."""
        began = time.monotonic()
        scenario_dir = self.log_dir / scenario.name
        scenario_dir.mkdir(parents=True, exist_ok=True)
        station = self.stations[scenario.broker]
        relays = RelayGroup(
            RELAYS, {**station.env, "CHAOS_JOURNAL_DIR": str(scenario_dir)}, scenario_dir
        )
        relays.start()
        supervisor = Supervisor(relays, self.heal_workers)
        worker_exits_before, worker_kills_before = len(station.exits), station.kills
        try:
            self._wait_relays_ready(relays)
            supervisor.start()
            lab = faults.Lab(
                pg=self.pg, redis=station.redis, rabbit=station.rabbit, worker=station.worker,
                station=station, relays=relays, queue=scenario.queue, scenario=scenario.name, rng=rng,
                quick=self.quick,
            )  # fmt: skip
            load = LoadGenerator(
                scenario.name, scenario.queue, rate=self.timing.rate, seed=rng.randrange(1 << 30)
            )
            load_window, window = self._load_and_fault(scenario, station, lab, load)
            result = self._settle(scenario, station, lab, load, (load_window, window))
            supervisor.stop()
            result["relay_exit_codes"] = relays.stop()
        finally:
            supervisor.stop()
            relays.stop()
        result["worker_exits"] = station.exits[worker_exits_before:]
        result["worker_kills"] = station.kills - worker_kills_before
        self._judge(scenario, relays, result, set(load.tally.committed))
        result["seconds"] = round(time.monotonic() - began, 1)
        return result

    def _wait_relays_ready(self, relays: RelayGroup) -> None:
        for relay in relays.relays:
            _wait(
                lambda r=relay: "outbox.relay_started" in r.log_tail(),  # past its start-up check
                READY_TIMEOUT,
                f"{relay.name} to connect",
            )

    def _load_and_fault(
        self, scenario: Scenario, station: Station, lab: faults.Lab, load: LoadGenerator
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        seconds = scenario.quick_seconds if self.quick else scenario.seconds
        load_start = time.time()
        load.start()
        self.sampler = OutboxSampler(self.pg.admin, lambda: station.site.depth(scenario.queue))
        self.sampler.start()
        try:
            time.sleep(self.timing.warmup)
            window = scenario.fault(lab, float(seconds or 0.0))
            time.sleep(self.timing.cooldown)
        finally:
            load.stop()
            lab.relays.thaw_all()
            self.sampler.stop()
        return (load_start, time.time()), window

    def _settle(
        self,
        scenario: Scenario,
        station: Station,
        lab: faults.Lab,
        load: LoadGenerator,
        windows: tuple[tuple[float, float], tuple[float, float]],
    ) -> dict[str, Any]:
        load_window, window = windows
        ambiguous = self._retry(lambda: self._resolve(load.tally))
        drain = accounting.DrainCheck(
            conn_factory=self.pg.admin, broker=station.site, queues=[scenario.queue],
            tally=load.tally, scenario=scenario.name, rows=lab.poison,
            reached_broker=lambda: station.site.snapshot()[0],
        ).wait(self.timing.drain_timeout)  # fmt: skip
        held = self._broker_leftover(station, scenario.queue)
        probes = self._probe_relays(lab, load)
        with self.pg.admin() as conn:
            done = accounting.executions(conn, scenario.name)
            applied = accounting.effects(conn, scenario.name)
            dead = accounting.dead_lettered(conn, set(load.tally.committed))
            verdicts = poison.verdicts(conn, lab.poison, lab.poison_stored, station.worker_log())
            leftover = accounting.outbox_leftover(
                conn, [p.task_id for p in lab.poison if p.expect == "kept"]
            )
            poison.cleanup(conn, lab.poison)
        result: dict[str, Any] = {
            "scenario": scenario.name,
            "what": scenario.what,
            "broker": scenario.broker,
        }
        published, taken = station.site.snapshot()
        journal_ids = journal.read(self.log_dir / scenario.name)
        result.update(
            accounting.count(
                load.tally,
                done,
                journal=journal_ids,
                published=published,
                taken=taken,
                dead=dead,
                redelivered=station.site.redelivered(),
                applied=applied,
                unacked=set(held.get("unacknowledged_task_ids", ())),
            )
        )
        result["broker_not_stored"] = accounting.not_stored(
            load.tally, station.site.received(), published
        )
        result.update(accounting.latency_figures(load.tally, done, window))
        result.update(accounting.commit_rates(load.tally, load_window, window))
        result.update(self.sampler.figures(window))
        result["timeline"] = accounting.timeline(load.tally, done, load_window[0])
        result["outbox_timeline"] = self.sampler.age_timeline(load_window[0])
        result["load_average"] = [round(x, 2) for x in os.getloadavg()]
        result.update(
            ambiguous_committed=ambiguous[0], ambiguous_not=ambiguous[1],
            drained=drain.drained, drain_seconds=round(drain.seconds, 1),
            broker_leftover={k: v for k, v in held.items() if not k.endswith("_ids")},
            outbox_leftover=leftover, broker_pending=drain.broker_pending,
            poison=verdicts, probes=probes, writer_errors=dict(load.tally.errors),
            fault_seconds=round(window[1] - window[0], 1),
            notify_queue_usage_max=max(lab.notify_usage) if lab.notify_usage else None,
            events=[(round(at - load_window[0], 2), text) for at, text in lab.events],
        )  # fmt: skip
        return result

    def _broker_leftover(self, station: Station, queue: str) -> dict[str, Any]:
        """What the broker still holds once the drain ended (drained or not), for the verdict."""
        try:
            return station.site.leftover([queue])
        except Exception as exc:  # the broker is unreachable: say so rather than fail the run
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _resolve(self, tally: Tally) -> tuple[int, int]:
        with self.pg.admin() as conn:
            return accounting.resolve_ambiguous(conn, tally)

    def _retry(self, action: Any, attempts: int = 60) -> Any:
        for attempt in range(attempts):
            try:
                return action()
            except Exception:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)
        return None

    def _probe_relays(self, lab: faults.Lab, load: LoadGenerator) -> dict[str, bool]:
        """Each relay alone (the others SIGSTOPped) must still get new messages executed."""
        results: dict[str, bool] = {}
        for relay in lab.relays.relays:
            others = [r for r in lab.relays.relays if r is not relay]
            for other in others:
                other.freeze()
            try:
                results[relay.name] = self._probe_one(lab.scenario, load)
            finally:
                for other in others:
                    other.thaw()
        return results

    def _probe_one(self, scenario: str, load: LoadGenerator) -> bool:
        before = set(load.tally.committed)
        for _ in range(PROBE_MESSAGES):
            load.write_one(rollback=False)
        wanted = set(load.tally.committed) - before
        deadline = time.monotonic() + PROBE_TIMEOUT
        while time.monotonic() < deadline:
            with self.pg.admin() as conn:
                if wanted <= set(accounting.executions(conn, scenario)):
                    return True
            time.sleep(0.1)
        return False

    # -- verdicts --------------------------------------------------------------------------

    def _judge(
        self, scenario: Scenario, relays: RelayGroup, result: dict[str, Any], committed: set[str]
    ) -> None:
        logs = {relay.name: relay.log_path.read_text(errors="replace") for relay in relays.relays}
        spent = accounting.retries_spent(logs.values(), committed)
        result["retries_spent"] = len(spent)
        result["retries_spent_sample"] = sorted(spent)[:10]
        result["relay_log_events"] = dict(
            Counter(
                event
                for text in logs.values()
                for event in LOG_EVENTS
                for _ in re.finditer(re.escape(event), text)
            )
        )
        result["relay_kills"] = relays.kills
        result["relay_start_refusals"] = [
            {"relay": c.relay, "message": c.log_tail.strip().splitlines()[-1][:300]}
            for c in relays.start_refusals
        ]
        result["relay_crashes"] = [
            {"relay": c.relay, "returncode": c.returncode, "log_tail": c.log_tail}
            for c in relays.crashes
        ]
        result["violations"] = _violations(scenario, result, self._leaks(logs))

    def _leaks(self, logs: dict[str, str]) -> list[str]:
        secrets = {"PostgreSQL password": self.pg.password}
        texts = dict(logs)
        for kind, station in self.stations.items():
            secrets.update(station.site.secrets())
            texts[f"{kind} worker"] = station.worker_log()
        return [
            f"{what} appears in the {name} log"
            for name, text in texts.items()
            for what, secret in secrets.items()
            if secret in text
        ]


def _violations(scenario: Scenario, result: dict[str, Any], leaks: list[str]) -> list[str]:
    checks = [
        (result["lost"] > 0, f"{result['lost']} committed message(s) never reached the broker"),
        (
            result["effects_applied"] != result["committed"] - result["lost_after_broker"]
            or result["effects_missing"] > 0,
            f"effects applied {result['effects_applied']} != committed {result['committed']} - "
            f"lost after broker {result['lost_after_broker']} ({result['effects_missing']} "
            f"missing, {result['effects_twice']} applied twice)",
        ),
        (result["effects_unexpected"] > 0, f"{result['effects_unexpected']} effect(s) of task ids never committed"),
        (result["dead_lettered"] > 0, f"{result['dead_lettered']} committed message(s) dead-lettered (never published)"),
        (result["retries_spent"] > 0, f"{result['retries_spent']} committed message(s) spent a retry (outbox.publish_failed): a broker fault was blamed on a message"),
        (result["duplicates_untraced"] > 0, f"{result['duplicates_untraced']} duplicate(s) neither published twice nor redelivered"),
        (result["rolled_back_published"] > 0, f"{result['rolled_back_published']} rolled-back message(s) published"),
        (result["rolled_back_executed"] > 0, f"{result['rolled_back_executed']} rolled-back message(s) executed"),
        (result["unknown_executed"] > 0, f"{result['unknown_executed']} execution(s) of unknown task ids"),
        (not result["drained"], f"did not drain within the timeout (broker: {result['broker_leftover']})"),
        (result["outbox_leftover"] > 0, f"{result['outbox_leftover']} row(s) left in the outbox"),
        (any(not v["ok"] for v in result["poison"]), "a poison row did not end as documented"),
        (bool(result["relay_crashes"]), f"{len(result['relay_crashes'])} relay crash(es)"),
        (not all(result["probes"].values()), f"a relay no longer relays on its own: {result['probes']}"),
        (any(code != 0 for code in result["relay_exit_codes"].values()), f"SIGTERM exit codes {result['relay_exit_codes']}"),
        (
            scenario.name not in DUPLICATE_WINDOWS and result["duplicates_republished"] > 0,
            f"{result['duplicates_republished']} duplicate(s) without a crash or outage",
        ),
    ]  # fmt: skip
    return [text for broken, text in checks if broken] + leaks
