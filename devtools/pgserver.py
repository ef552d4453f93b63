"""Throwaway PostgreSQL servers for the tests, the demo, the benchmarks and the chaos suite.

Wraps pytest-postgresql's process executor (pg_ctl from PATH, or from `pg_config --bindir`,
or Debian's /usr/lib/postgresql/<version>/bin). initdb and postgres refuse to run as root,
so when we are root the server runs as an unprivileged user through a tiny pg_ctl wrapper.
Only servers started here are ever stopped, restarted or killed by our code.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import random
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pytest_postgresql.executors import PostgreSQLExecutor

UNPRIVILEGED_USERS = ("postgres", "outbox-pg")
SUPERUSER = "postgres"
# Settings for a disposable cluster: durability off (nothing here must survive a power cut),
# room for many test connections.
FAST_OPTIONS = "-c fsync=off -c full_page_writes=off -c max_connections=300"


def find_pg_ctl() -> str:
    """Path of pg_ctl: PATH, then `pg_config --bindir`, then Debian's versioned folders."""
    found = shutil.which("pg_ctl")
    if found:
        return found
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        bindir = subprocess.check_output(["pg_config", "--bindir"], text=True).strip()
        if os.access(os.path.join(bindir, "pg_ctl"), os.X_OK):
            return os.path.join(bindir, "pg_ctl")
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)
    if candidates:
        return candidates[0]
    raise RuntimeError(
        "no PostgreSQL server binaries found (pg_ctl is not on PATH, not in `pg_config "
        "--bindir`, nor in /usr/lib/postgresql/*/bin): install the PostgreSQL server, or "
        "point the tests at a running server with OUTBOX_TEST_DATABASE_URL"
    )


# Ports handed to servers come from below Linux's ephemeral range (32768-60999 by default):
# a port the kernel picked for us would be free now, but any outgoing connection of this
# machine may take it as its local port before a slow server (RabbitMQ: seconds) binds it.
SERVER_PORTS = range(20_000, 32_000)
_given: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, and that no client will take.

    Chosen at random outside the ephemeral range and never twice in one process, so two
    servers of one test, or a server and an outgoing connection, do not race for it.
    """
    for _ in range(200):
        port = random.choice(SERVER_PORTS)
        if port in _given:
            continue
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            _given.add(port)
            return port
    raise RuntimeError(f"no free TCP port found in {SERVER_PORTS}")


def unprivileged_user() -> pwd.struct_passwd:
    for name in UNPRIVILEGED_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(
        [
            "useradd",
            "--system",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            UNPRIVILEGED_USERS[-1],
        ],
        check=True,
    )
    return pwd.getpwnam(UNPRIVILEGED_USERS[-1])


def _executable(base: Path) -> str:
    """A pg_ctl wrapper: UTF-8 clusters always, and an unprivileged user when we are root."""
    pg_ctl = find_pg_ctl()
    # initdb takes the cluster's encoding from the locale; without this a bare environment
    # gives SQL_ASCII, which would hide encoding bugs production (UTF-8) would show.
    command = f'env LC_ALL=C.UTF-8 LANG=C.UTF-8 "{pg_ctl}" "$@"'
    if os.geteuid() == 0:
        user = unprivileged_user()
        os.chown(base, user.pw_uid, user.pw_gid)
        command = f"setpriv --reuid={user.pw_uid} --regid={user.pw_gid} --clear-groups --reset-env {command}"
    wrapper = base / "pg_ctl-wrapper"
    # From `/`: initdb, pg_ctl and the postmaster start in the caller's directory, and say
    # "could not change directory" when the unprivileged user cannot read it (a home dir).
    wrapper.write_text(f"#!/bin/sh\ncd / || exit 1\nexec {command}\n")
    wrapper.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    return str(wrapper)


@dataclass
class PrivateServer:
    """A running PostgreSQL cluster that this process started and owns."""

    base: Path
    executor: PostgreSQLExecutor
    port: int
    host: str = "127.0.0.1"
    user: str = SUPERUSER
    stopped: bool = field(default=False)

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL for one database of this server."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster); the data directory stays."""
        self.executor.stop()
        self.stopped = True

    def start(self) -> None:
        """Start again after stop(), on the same port and data."""
        self.executor.start()
        wait_until_accepting(self.url())
        self.stopped = False

    def restart(self) -> None:
        """Fast shutdown then start: every connection is cut."""
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop the server if running and delete everything it wrote."""
        with contextlib.suppress(Exception):
            if not self.stopped:
                self.executor.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def wait_until_accepting(url: str, timeout: float = 60.0) -> None:
    """Block until the server takes connections (its port opens while it is still starting up)."""
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(url, connect_timeout=2):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start(options: str = FAST_OPTIONS, port: int | None = None) -> PrivateServer:
    """initdb and start a fresh cluster on a free port; the caller must destroy() it."""
    base = Path(tempfile.mkdtemp(prefix="outbox-notify-pg-"))
    base.chmod(0o755)
    port = port or free_port()
    executor: PostgreSQLExecutor | None = None
    try:
        executor = PostgreSQLExecutor(
            executable=_executable(base),
            host="127.0.0.1",
            port=port,
            datadir=str(base / "data"),
            unixsocketdir=str(base),
            logfile=str(base / "server.log"),
            startparams="-w",
            dbname="postgres",
            user=SUPERUSER,
            postgres_options=options,
            timeout=120,
        )
        executor.start()
        wait_until_accepting(f"postgresql://{SUPERUSER}@127.0.0.1:{port}/postgres")
    except BaseException:
        # Interrupted part-way: a postmaster may already run on that data directory.
        if executor is not None:
            with contextlib.suppress(Exception):
                executor.stop()
        shutil.rmtree(base, ignore_errors=True)
        raise
    return PrivateServer(base=base, executor=executor, port=port)


@contextlib.contextmanager
def running(options: str = FAST_OPTIONS) -> Iterator[PrivateServer]:
    """A private server for the length of a `with` block, removed even when the block fails."""
    server = start(options)
    try:
        yield server
    finally:
        server.destroy()


if __name__ == "__main__":
    # Smoke check: start, print the URL, stop.
    with running() as srv:
        print(srv.url())
