"""The relay and the Celery worker as subprocesses, each with its output in a log file.

Each runs in its own session (process group): Ctrl-C in the terminal reaches only the demo,
which then stops them in order, and a prefork worker's pool children can be killed with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
MANAGE_PY = ROOT / "example" / "manage.py"
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
READY_TIMEOUT = 60.0  # seconds: generous, a cold worker start takes a few
POLL_INTERVAL = 0.05  # seconds


class ProcessFailed(RuntimeError):
    """A subprocess exited, or never became ready; the message carries its log's tail."""


@dataclasses.dataclass(kw_only=True)
class ManagedProcess:
    """One subprocess the demo started, and the log file its output goes to."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    @property
    def pid(self) -> int:
        """The subprocess's pid (also its process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the subprocess has not exited."""
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        """The last lines of the log, indented, for error messages."""
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join("    | " + line for line in text) or "    | (no output)"

    def failure(self, what: str) -> ProcessFailed:
        """A ProcessFailed naming this process, its exit code and its log."""
        code = self.proc.poll()
        status = "is still running" if code is None else f"exited with code {code}"
        return ProcessFailed(f"{self.name} {what} ({status}); log {self.log_path}:\n{self.tail()}")

    def wait_ready(self, ready_file: Path, timeout: float = READY_TIMEOUT) -> None:
        """Block until ready_file exists; raise if the process exits or the timeout passes."""
        deadline = time.monotonic() + timeout
        while not ready_file.exists():
            if not self.alive():
                raise self.failure("stopped before it was ready")
            if time.monotonic() > deadline:
                raise self.failure(f"was not ready after {timeout:.0f} s")
            time.sleep(POLL_INTERVAL)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM: the relay drains, the worker warm-shuts down)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def finish(self, grace: float = STOP_GRACE) -> int | None:
        """Wait up to `grace` after terminate(), then SIGKILL the group; close the log."""
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
            # Also reaps pool children a SIGKILLed (or crashed) worker may have left behind.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
            return self.proc.poll()
        finally:
            self.log.close()


def start(name: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> ManagedProcess:
    """Start argv from the repository root in a new session, output appended to log_path."""
    log = log_path.open("ab")
    try:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        log.close()
        raise
    return ManagedProcess(name=name, proc=proc, log_path=log_path, log=log)


def relay_argv(liveness_file: Path) -> list[str]:
    """`manage.py outbox_listen`, touching liveness_file once it is connected."""
    return [
        sys.executable,
        str(MANAGE_PY),
        "outbox_listen",
        "--liveness-file",
        str(liveness_file),
        "--shutdown-timeout",
        "5",
    ]


def consumer_argv() -> list[str]:
    """`manage.py outbox_consume` running the shop's event consumer."""
    return [sys.executable, str(MANAGE_PY), "outbox_consume", "example.shop.consumers.consumer"]


def worker_argv(queue: str, concurrency: int) -> list[str]:
    """A Celery worker of the example app, consuming only the demo's queue."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "example.project.celery",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        str(concurrency),
        "-Q",
        queue,
        "--loglevel",
        "warning",
        "--hostname",
        f"outbox-demo-{os.getpid()}@%h",
        # Nothing to synchronise with: a lone worker starts faster without these.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


def stop_all(processes: list[ManagedProcess]) -> list[str]:
    """SIGTERM every process, then wait for each (SIGKILL after the grace period)."""
    for process in processes:
        process.terminate()
    notes = []
    for process in processes:
        code = process.finish()
        if code not in (0, None, -signal.SIGTERM):
            notes.append(f"{process.name} exited with code {code} (log {process.log_path})")
    return notes
