"""Subprocesses a chaos run owns: relays (`manage.py outbox_listen`) and a Celery worker.

Each process writes to a log file that is kept after the run. The run supervises its relays:
one that exits without having been killed by the run is a crash, recorded and restarted.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT = 20.0  # seconds a process gets to exit after SIGTERM before SIGKILL
LOG_TAIL = 2000  # characters of a log quoted in a crash report

# Short timeouts so that every fault resolves within seconds (see docs/reliability.md).
RELAY_FLAGS = (
    "--sweep-interval", "1",
    "--stale-timeout", "5",
    "--send-timeout", "2",
    "--broker-outage-cooldown", "1",
    "--backoff-time", "0.2",
    "--max-backoff", "1",
    "--max-retries", "5",
    "--shutdown-timeout", "3",
)  # fmt: skip
STALE_TIMEOUT = 5.0  # seconds, as in RELAY_FLAGS


class Process:
    """One subprocess with its log file; signals go to its pid only."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    def start(self) -> None:
        """Start (or start again); output is appended to the log."""
        with self.log_path.open("ab") as log:
            log.write(f"\n=== chaos: start {self.name} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.frozen = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def send(self, signum: int) -> None:
        """Send a signal to this process if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.send(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=STOP_TIMEOUT)

    def freeze(self) -> None:
        self.send(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.send(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> int | None:
        """SIGTERM (after SIGCONT), wait, SIGKILL past STOP_TIMEOUT; return the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.thaw()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
                return None
        return self.proc.returncode

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL:]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Crash:
    """A relay that exited on its own."""

    relay: str
    returncode: int | None
    at: float
    log_tail: str


class RelayGroup:
    """The run's relays: killed, frozen and restarted by faults; crashes noticed and healed."""

    def __init__(self, count: int, env: dict[str, str], log_dir: Path) -> None:
        self.relays = [_relay(f"relay-{chr(ord('a') + i)}", env, log_dir) for i in range(count)]
        self.lock = threading.Lock()
        self.crashes: list[Crash] = []
        self.start_refusals: list[Crash] = []
        self.kills = 0

    def start(self) -> None:
        for relay in self.relays:
            relay.start()

    def kill_and_restart(self, relay: Process, pause: float = 0.0) -> None:
        """SIGKILL one relay (wherever it is) and start a new process in its place."""
        with self.lock:  # held throughout, so heal() never mistakes the kill for a crash
            relay.kill()
            self.kills += 1
            time.sleep(pause)
            relay.start()

    def heal(self) -> None:
        """Record and restart every relay that exited without being told to.

        A relay started while PostgreSQL or the broker is down exits at once with a
        CommandError (documented: it refuses to start); that is a start refusal, restarted
        as a process supervisor would, not a crash.
        """
        with self.lock:
            for relay in self.relays:
                code = relay.returncode()
                if relay.proc is None or code is None:
                    continue
                tail = relay.log_tail()
                record = Crash(relay=relay.name, returncode=code, at=time.time(), log_tail=tail)
                if _refused_to_start(tail):
                    self.start_refusals.append(record)
                else:
                    self.crashes.append(record)
                relay.start()

    def thaw_all(self) -> None:
        for relay in self.relays:
            if relay.frozen:
                relay.thaw()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every relay; return each exit code (0 expected: they drain and exit)."""
        with self.lock:
            return {relay.name: relay.stop() for relay in self.relays}


def _refused_to_start(log_tail: str) -> bool:
    lines = log_tail.rsplit("=== chaos: start", maxsplit=1)[-1].strip().splitlines()
    return any(
        line.startswith("CommandError: ") and "cannot be reached" in line for line in lines[-3:]
    )


def _relay(name: str, env: dict[str, str], log_dir: Path) -> Process:
    argv = [
        sys.executable, "-m", "django", "outbox_listen", *RELAY_FLAGS,
        "--liveness-file", str(log_dir / f"{name}.alive"),
    ]  # fmt: skip
    return Process(name, argv, env, log_dir / f"{name}.log")


def worker(env: dict[str, str], log_path: Path, queue: str) -> Process:
    """A real Celery worker consuming the chaos queue (threads: its task waits on PostgreSQL)."""
    argv = [
        sys.executable, "-m", "celery", "-A", "chaos.celery_app", "worker",
        "-Q", queue, "-c", "8", "--pool", "threads", "-l", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-n", f"chaos-{os.getpid()}@localhost",
    ]  # fmt: skip
    return Process("worker", argv, env, log_path)


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.exists() else ():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def owner_of_local_port(processes: list[Process], port: int) -> Process | None:
    """The process whose TCP socket has this local port on 127.0.0.1 (Linux /proc)."""
    wanted = f"0100007F:{port:04X}"
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == wanted:
            inode = fields[9]
            break
    if inode is None:
        return None
    for process in processes:
        if process.pid is not None and inode in _socket_inodes(process.pid):
            return process
    return None
