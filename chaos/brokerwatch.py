"""Watches the private Redis with MONITOR: which task ids it really received, and which a
worker took into its unacknowledged set.

This is the ground truth the accounting needs to say *where* a message was lost: never handed
to the broker (the outbox's fault), or lost between the broker and the worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections import Counter

POLL = 0.2  # seconds between reconnection attempts while the broker is down
READ_TIMEOUT = 0.5  # seconds
# The task id in a kombu envelope's headers, as MONITOR quotes it: \"id\": \"<id>\" (kombu's
# own encoder puts a space after the colon, the relay's Redis fast path does not).
TASK_ID = re.compile(rb'\\"id\\": ?\\"([^\\"]+)\\"')
# kombu marks a message it puts back (visibility timeout, worker shutdown) as redelivered.
RESTORED = re.compile(rb'\\"redelivered\\": ?true')


class BrokerWatch(threading.Thread):
    """A MONITOR session (reopened after each broker restart) collecting task ids."""

    def __init__(self, port: int, password: str, queue: str) -> None:
        super().__init__(name="broker-watch", daemon=True)
        self.port = port
        self.password = password
        self.push_marker = f'"LPUSH" "{queue}"'.encode()
        self.restore_marker = f'"RPUSH" "{queue}"'.encode()  # kombu putting a message back
        self.unacked_marker = b'"HSET" "unacked"'
        self.published: Counter[str] = Counter()  # LPUSHes of new messages (relays)
        self.restored: Counter[str] = Counter()  # LPUSHes of messages kombu put back
        self.taken: set[str] = set()
        self.sessions = 0
        self.done = threading.Event()
        self.lock = threading.Lock()
        dump = os.environ.get("CHAOS_MONITOR_DUMP")  # debugging: keep every MONITOR line
        self.dump = open(dump, "ab") if dump else None  # noqa: SIM115 - closed in stop()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(OSError):
                self._watch_once()
            self.done.wait(POLL)

    def _watch_once(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(f"AUTH {self.password}\r\nMONITOR\r\n".encode())
            sock.settimeout(READ_TIMEOUT)
            self.sessions += 1
            pending = b""
            while not self.done.is_set():
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\r\n")
                self._scan(lines)
                if self.dump is not None:
                    self.dump.write(b"\n".join(lines) + b"\n")

    def _scan(self, lines: list[bytes]) -> None:
        for line in lines:
            pushed = self.push_marker in line or self.restore_marker in line
            if not pushed and self.unacked_marker not in line:
                continue
            # One LPUSH may carry a whole batch of messages (kombu's pipelined publish).
            task_ids = [found.decode() for found in TASK_ID.findall(line)]
            with self.lock:
                if not pushed:
                    self.taken.update(task_ids)
                elif RESTORED.search(line):
                    self.restored.update(task_ids)
                else:
                    self.published.update(task_ids)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        if self.dump is not None:
            self.dump.close()

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        """(LPUSHes per task id of new messages, task ids a worker moved to `unacked`)."""
        with self.lock:
            return Counter(self.published), set(self.taken)


def wait_started(watch: BrokerWatch, timeout: float = 10.0) -> None:
    """Return once the watch has a MONITOR session open."""
    deadline = time.monotonic() + timeout
    while watch.sessions == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
