"""One broker's part of a chaos run: its site, the environment of the processes that use it,
and the Celery worker consuming it (restarted when it exits, each exit recorded)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from chaos.processes import ROOT, Process, worker
from chaos.sites import Site

READY_TIMEOUT = 60.0  # seconds for the worker to come up
# A worker whose log has not grown for this long while its broker holds ready messages has
# stopped consuming (a Celery worker can stay "Connected" after a reconnect without
# consuming again: celery/celery#8030 and kin). It is restarted, as a liveness probe would.
STALL_AFTER = 15.0  # seconds


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def environment(database_url: str, broker_url: str, queue: str) -> dict[str, str]:
    """Environment of the relays and the worker of one broker."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="chaos.settings",
        CHAOS_DATABASE_URL=database_url,
        CHAOS_BROKER_URL=broker_url,
        CHAOS_QUEUE=queue,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    return env


STALLED = "restarted: its log stood still while the broker held messages for it (stalled)"


class Station:
    """A broker's site, its processes' environment and its worker."""

    def __init__(
        self,
        site: Site,
        env: dict[str, str],
        log_dir: Path,
        queues: list[str],
        *,
        servers: tuple[Any, Any],
    ) -> None:
        self.site = site
        self.env = env
        # The server faults act on: (PrivateRedis, None) or (None, ChaosRabbit).
        self.redis, self.rabbit = servers
        self.log_path = log_dir / f"worker-{site.kind}.log"
        self.queues = queues
        self.worker: Process = worker(env, self.log_path, ",".join(queues))
        self.exits: list[dict[str, Any]] = []
        self.kills = 0  # SIGKILLs by a fault (scenario worker_kill), not exits
        self.lock = threading.Lock()  # a kill and its restart are never taken for an exit
        self.log_seen = (-1, time.monotonic())  # (log size, when it last changed)

    def start(self) -> None:
        """Watch the broker, then start the worker and wait until it is ready."""
        self.site.start_watch()
        self.worker.start()
        process = self.worker
        _wait(
            lambda: " ready." in self.worker_log() or not process.running(),
            READY_TIMEOUT,
            f"the Celery worker on {self.site.label}",
        )
        if not process.running():
            raise RuntimeError(f"the Celery worker exited:\n{process.log_tail()}")

    def kill_and_restart(self) -> None:
        """SIGKILL the worker (mid-task: `acks_late` leaves its messages unacknowledged) and
        start a new one in its place."""
        with self.lock:
            self.worker.kill()
            self.kills += 1
            self.worker.start()

    def ready_since_start(self) -> bool:
        """Whether the worker started last is consuming (Celery logged ` ready.`)."""
        return " ready." in self.worker_log().rsplit("=== chaos: start", 1)[-1]

    def heal(self) -> None:
        """Start the worker again if it exited or stalled (Celery/kombu, not the relay)."""
        with self.lock:
            self._heal()

    def _heal(self) -> None:
        process = self.worker
        if process.proc is None:
            return
        if process.running():
            if self._stalled():
                self.exits.append({"at": time.time(), "returncode": None, "error": [STALLED]})
                process.stop()
                process.start()
            return
        text = process.log_path.read_text(errors="replace")
        error = [line for line in text.splitlines() if "Unrecoverable error" in line]
        self.exits.append(
            {"at": time.time(), "returncode": process.returncode(), "error": error[-1:]}
        )
        process.start()

    def _stalled(self) -> bool:
        """Whether the worker's log stood still for STALL_AFTER s while messages wait for it."""
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        now = time.monotonic()
        if size != self.log_seen[0] or self.worker.frozen:
            self.log_seen = (size, now)
            return False
        if now - self.log_seen[1] < STALL_AFTER:
            return False
        try:
            waiting = self.site.pending(self.queues)
        except Exception:  # the broker is down or frozen: nothing to judge the worker by
            return False
        self.log_seen = (size, now)
        return waiting > 0

    def worker_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        self.worker.stop()
        self.site.stop_watch()
