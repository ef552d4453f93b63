"""Processes the benchmark starts, and what /proc says about their CPU.

Every process goes through one Processes registry whose stop_all() runs in a finally block:
nothing outlives the benchmark, whether it ends normally, on an error or on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc times are in these per second
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
READY_TIMEOUT = 60.0  # seconds a relay has to say it is ready
POLL = 0.05  # seconds between checks while waiting for something


class BenchError(Exception):
    """A scenario cannot go on (a process died, a deadline passed, a tool failed)."""


def _stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    # The command name sits in parentheses and may contain spaces: split after it.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """utime + stime of one process (plus its reaped children's), in seconds; 0 once gone."""
    try:
        fields = _stat_fields(pid)
    except (OSError, ValueError):
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLOCK_TICKS


def _children_of(parent: int) -> list[int]:
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(_stat_fields(int(entry.name))[1]) == parent:
                found.append(int(entry.name))
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU of a server: the root process, its reaped children and its live children."""
    return cpu_seconds(root, children=True) + sum(cpu_seconds(p) for p in _children_of(root))


def socket_ports(pid: int) -> list[int]:
    """Local TCP ports of the sockets a process holds (to find its PostgreSQL backends)."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports: list[int] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[9] in inodes:
                    ports.append(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


class Proc:
    """One started process, its log file, and the signals the scenarios send it."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu(self) -> float:
        """CPU seconds used so far."""
        return cpu_seconds(self.pid)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait_for_output(self, marker: str, timeout: float = READY_TIMEOUT) -> None:
        """Block until `marker` shows in the log; BenchError if the process dies first."""
        deadline = time.monotonic() + timeout
        while marker not in self.output():
            if not self.alive():
                raise BenchError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} never logged {marker!r}:\n{self.tail()}")
            time.sleep(POLL)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


class Processes:
    """The registry of every process the benchmark started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[Proc] = []
        self.counter = 0

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None = None
    ) -> Proc:
        """Start argv with its output in a log file of its own (in `cwd`, default ours)."""
        self.counter += 1
        log_path = self.log_dir / f"{self.counter:03d}-{name}.log"
        log: IO[bytes] = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd or Path.cwd(),
            )
        finally:
            log.close()
        proc = Proc(name, popen, log_path)
        self.running.append(proc)
        return proc

    def stop(self, proc: Proc, signum: int = signal.SIGTERM) -> int | None:
        """Resume (if stopped), signal, then SIGKILL after the grace period; returns the status."""
        if proc.alive():
            proc.send(signal.SIGCONT)
            proc.send(signum)
            try:
                proc.popen.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.send(signal.SIGKILL)
                proc.popen.wait(STOP_GRACE)
        if proc in self.running:
            self.running.remove(proc)
        return proc.popen.returncode

    def stop_all(self) -> None:
        """Stop everything still running, newest first."""
        for proc in reversed(list(self.running)):
            with contextlib.suppress(Exception):
                self.stop(proc)

    @contextlib.contextmanager
    def started(
        self, procs: Callable[[], list[Proc]], signum: int = signal.SIGTERM
    ) -> Iterator[list[Proc]]:
        """Processes for the length of a block, stopped (with `signum`) when it ends."""
        started: list[Proc] = []
        try:
            started = procs()
            yield started
        finally:
            for proc in started:
                self.stop(proc, signum)


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = POLL
) -> float:
    """Poll until predicate() is truthy; the monotonic time it became so. BenchError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
