"""Watches the private Redis with MONITOR: which task ids it really received, and which a
worker took into its unacknowledged set.

This is the ground truth the accounting needs to say *where* a message was lost: never handed
to the broker (the outbox's fault), or lost between the broker and the worker.

Copies are told apart by their kombu delivery tag, a fresh uuid at every publish that a
message put back (visibility timeout, worker shutdown, reject) keeps. A task id with two tags
was published twice. (A client that sent the same LPUSH twice, a retry inside redis-py, would
store two copies under one tag; neither the relays' nor the workers' clients retry commands.) MONITOR misses the commands a stopping server ran last (it exits before
sending their lines, and their replies); the restarted server's lists hold what those
commands stored, so `catch_up()`, run before the restarted server opens its TCP port, reads
the lists and the unacknowledged set, and reattaches MONITOR before any client is back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from chaos.services import unix_command

POLL = 0.2  # seconds between reconnection attempts while the broker is down
READ_TIMEOUT = 0.5  # seconds
CATCH_UP_TIMEOUT = 10.0  # seconds for MONITOR to reattach to a restarted server
# The task id in a kombu envelope's headers, as MONITOR quotes it: \"id\": \"<id>\" (kombu's
# own encoder puts a space after the colon, the relay's Redis fast path does not).
TASK_ID = re.compile(rb'\\"id\\": ?\\"([^\\"]+)\\"')
# The envelope's delivery tag, after its headers in kombu's envelope (one per envelope).
DELIVERY_TAG = re.compile(rb'\\"delivery_tag\\": ?\\"([^\\"]+)\\"')
# kombu marks a message it puts back (visibility timeout, worker shutdown) as redelivered.
RESTORED = re.compile(rb'\\"redelivered\\": ?true')
UNACKED = "unacked"  # kombu's hash of messages a worker took (delivery tag -> message)


class BrokerWatch(threading.Thread):
    """A MONITOR session (reopened after each broker restart) collecting task ids and the
    delivery tags of their copies."""

    def __init__(self, socket_path: str, password: str, queue: str) -> None:
        super().__init__(name="broker-watch", daemon=True)
        self.socket_path = socket_path
        self.password = password
        self.queue = queue
        self.push_marker = f'"LPUSH" "{queue}"'.encode()
        self.restore_marker = f'"RPUSH" "{queue}"'.encode()  # kombu putting a message back
        self.unacked_marker = f'"HSET" "{UNACKED}"'.encode()
        self.copies: defaultdict[str, set[str]] = defaultdict(set)  # task id -> delivery tags
        self.restored: Counter[str] = Counter()  # pushes of messages kombu put back
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
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(self.socket_path)
            sock.sendall(f"AUTH {self.password}\r\nMONITOR\r\n".encode())
            sock.settimeout(READ_TIMEOUT)
            pending = b""
            replies = 0  # +OK to AUTH, then to MONITOR
            while not self.done.is_set():
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\r\n")
                if replies < 2:
                    replies += lines.count(b"+OK")
                    if replies >= 2:  # MONITOR's reply: from here on it sees every command
                        self.sessions += 1
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
            tags = [found.decode() for found in DELIVERY_TAG.findall(line)]
            restored = pushed and RESTORED.search(line) is not None
            with self.lock:
                if len(tags) == len(task_ids):
                    for task_id, tag in zip(task_ids, tags, strict=True):
                        self.copies[task_id].add(tag)
                elif pushed and not restored:  # no kombu envelope: each publish is a copy
                    for task_id in task_ids:
                        self.copies[task_id].add(f"push:{len(self.copies[task_id])}")
                if not pushed:
                    self.taken.update(task_ids)
                elif restored:
                    self.restored.update(task_ids)

    def catch_up(self) -> str:
        """Before a restarted server opens its port: count the copies its lists and its
        unacknowledged set hold (stored by commands MONITOR never showed), then wait until
        this server has a MONITOR client (the watch's, back), unless the watch has stopped."""
        queued = unix_command(self.socket_path, self.password, "LRANGE", self.queue, 0, -1)
        unacked = unix_command(self.socket_path, self.password, "HVALS", UNACKED)
        # An unacknowledged entry is [message, exchange, routing key].
        envelopes = [(json.loads(raw), False) for raw in queued]
        envelopes += [(json.loads(raw)[0], True) for raw in unacked]
        unseen = 0
        with self.lock:
            for envelope, taken in envelopes:
                task_id, tag = _identity(envelope)
                if task_id is None or tag is None:
                    continue
                unseen += tag not in self.copies[task_id]
                self.copies[task_id].add(tag)
                if taken:
                    self.taken.add(task_id)
                elif _redelivered(envelope):
                    self.restored[task_id] += 1
        deadline = time.monotonic() + CATCH_UP_TIMEOUT
        # Asked of this server, not counted by the watch: its new session may have attached
        # before this method began.
        while self.is_alive() and not self.done.is_set() and not self._monitored():
            if time.monotonic() > deadline:
                raise RuntimeError("MONITOR did not reattach to the restarted redis-server")
            time.sleep(0.02)
        return f"{len(envelopes)} messages kept, {unseen} of them never shown by MONITOR"

    def _monitored(self) -> bool:
        """Whether the server has a client in MONITOR mode (flag O in CLIENT LIST)."""
        listed = unix_command(self.socket_path, self.password, "CLIENT", "LIST") or b""
        return any(
            field.startswith(b"flags=") and b"O" in field[6:]
            for line in listed.splitlines()
            for field in line.split()
        )

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        if self.dump is not None:
            self.dump.close()

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        """(copies per task id: distinct delivery tags, task ids a worker moved to `unacked`)."""
        with self.lock:
            return Counter({tid: len(tags) for tid, tags in self.copies.items()}), set(self.taken)


def _redelivered(envelope: Any) -> bool:
    """Whether kombu put this envelope back (it marks its headers)."""
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    return bool(isinstance(headers, dict) and headers.get("redelivered"))


def _identity(envelope: Any) -> tuple[str | None, str | None]:
    """(task id, delivery tag) of one kombu envelope read from Redis."""
    try:
        return str(envelope["headers"]["id"]), str(envelope["properties"]["delivery_tag"])
    except (LookupError, TypeError):
        return None, None


def wait_started(watch: BrokerWatch, timeout: float = 10.0) -> None:
    """Return once the watch has a MONITOR session open."""
    deadline = time.monotonic() + timeout
    while watch.sessions == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
