"""Helpers for tests that run the relay (and workers) as real subprocesses."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from devtools.process import stop_process

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0  # seconds: generous, these tests wait for events, they do not time them


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = DEADLINE,
    interval: float = 0.05,
    what: str = "",
    context: Callable[[], str] | None = None,
) -> Any:
    """Poll until predicate() is truthy; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n--- context ---\n{context()}" if context else ""
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what or predicate}{extra}"
            )
        time.sleep(interval)


def run_python(script: str, env: dict[str, Any], *args: str, timeout: float = 120) -> str:
    """Run a Python snippet in a subprocess at the repository root; return its last output line."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"the script failed ({done.returncode}):\n{done.stderr}"
    return done.stdout.strip().splitlines()[-1]


class RelayProcess:
    """A `manage.py outbox_listen` (or `outbox_sweep`) subprocess with captured output.

    `python` and `cwd`: another release's interpreter and project (tests/acceptance/test_upgrade.py).
    """

    def __init__(
        self,
        command: str,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        python: str | Path = sys.executable,
        cwd: Path = ROOT,
    ) -> None:
        self.log_path = log_path
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(python), "-m", "django", command, *args],
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Terminate if still running (SIGKILL after a grace period); always close the log."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=15)
        finally:
            self.log.close()


class WorkerProcess:
    """A real Celery worker subprocess (`celery -A APP worker`, solo pool) on one queue."""

    STOP_TIMEOUT = 20.0  # seconds for a warm shutdown before SIGKILL

    def __init__(self, app: str, queue: str, env: dict[str, Any], log_path: Path) -> None:
        self.log_path = log_path
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "worker",
                "-Q",
                queue,
                "--pool",
                "solo",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "--loglevel",
                "info",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL) and close its log."""
        try:
            stop_process(self.proc, timeout=self.STOP_TIMEOUT)
        finally:
            self.log.close()


class RedisQueue:
    """Reads Celery messages that a relay LPUSHed onto one Redis list."""

    def __init__(self, url: str, name: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.name = name

    def messages(self) -> list[dict[str, Any]]:
        """Every message in the queue (oldest first), envelope decoded, queue left as is."""
        raw = self.client.lrange(self.name, 0, -1)
        return [decode_envelope(item) for item in reversed(raw)]

    def task_ids(self) -> list[str]:
        return [m["headers"]["id"] for m in self.messages()]

    def clear(self) -> None:
        self.client.delete(self.name)


def decode_envelope(raw: bytes) -> dict[str, Any]:
    """kombu's Redis envelope -> {headers, properties, body (decoded JSON)}."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    envelope["body"] = json.loads(body)
    return envelope


def claim_params(limit: int, *, max_version: int) -> dict[str, Any]:
    """Parameters of claim_batch for a relay that starts from nothing (a new relay's frontier)."""
    from outbox_notify.relay.frontier import Frontier

    return {**Frontier().params(), "limit": limit, "max_version": max_version}
