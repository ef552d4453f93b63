"""Private redis-server processes for fault tests: started, stopped and restarted by us only."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from devtools.pgserver import free_port
from devtools.process import stop_process

START_TIMEOUT = 10.0  # seconds


@dataclass
class PrivateRedis:
    """A redis-server subprocess on a free loopback port, nothing kept on disk."""

    port: int
    process: subprocess.Popen[bytes] | None = field(default=None)

    def url(self, db: int = 0) -> str:
        """redis:// URL of one database of this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        """Start (again) on the same port and wait until it accepts connections."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); connections to it break."""
        if self.process is None:
            return
        stop_process(self.process)
        self.process = None


def _answers(port: int) -> bool:
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock,
    ):
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
    return False


@contextlib.contextmanager
def running() -> Iterator[PrivateRedis]:
    """A private Redis for the length of a `with` block, stopped even when the block fails."""
    server = PrivateRedis(port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
