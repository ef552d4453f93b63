"""A private PgBouncer in front of a PostgreSQL server, for tests of the relay behind a pooler.

Transaction pooling with a tiny pool, so consecutive transactions of one client really do land
on different server connections. Started and stopped by the test that uses it only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from devtools.pgserver import free_port, unprivileged_user
from devtools.process import stop_process

START_TIMEOUT = 10.0  # seconds


def find_pgbouncer() -> str | None:
    """The pgbouncer binary from PATH (Debian installs it in /usr/sbin)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


@dataclass
class PrivateBouncer:
    """A pgbouncer process on a free loopback port; `url()` reaches a database through it."""

    base: Path
    port: int
    server_user: str
    process: subprocess.Popen[bytes]

    def url(self, dbname: str) -> str:
        """A libpq URL for `dbname` through the pooler."""
        return f"postgresql://{self.server_user}@127.0.0.1:{self.port}/{dbname}"

    def log(self) -> str:
        """What pgbouncer logged so far (for failure messages)."""
        with contextlib.suppress(OSError):
            return (self.base / "pgbouncer.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        """Stop pgbouncer (SIGTERM, then SIGKILL) and delete its files."""
        try:
            stop_process(self.process)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


def start(server_url: str, *, pool_mode: str = "transaction", pool_size: int = 2) -> PrivateBouncer:
    """Start pgbouncer in front of the server at `server_url` (any database on it)."""
    binary = find_pgbouncer()
    if binary is None:
        raise RuntimeError("pgbouncer is not installed")
    server = urlsplit(server_url)
    user = server.username or "postgres"
    port = free_port()
    base = Path(tempfile.mkdtemp(prefix="outbox-notify-pgbouncer-"))
    try:
        secret = unquote(server.password or "").replace("\\", "\\\\").replace("'", "\\'")
        password = f" password='{secret}'" if secret else ""
        # auth_type=any: clients are not checked; every server connection logs in as `user`.
        (base / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server.hostname or '127.0.0.1'} port={server.port or 5432} user={user}{password}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 100\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {base / 'pgbouncer.log'}\n"
        )
        command = [binary, str(base / "pgbouncer.ini")]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            account = unprivileged_user()
            os.chown(base, account.pw_uid, account.pw_gid)
            for path in base.iterdir():
                os.chown(path, account.pw_uid, account.pw_gid)
            command = [
                "setpriv",
                f"--reuid={account.pw_uid}",
                f"--regid={account.pw_gid}",
                "--clear-groups",
                *command,
            ]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    bouncer = PrivateBouncer(base=base, port=port, server_user=user, process=process)
    try:
        _wait_until_accepting(bouncer)
    except BaseException:
        bouncer.stop()
        raise
    return bouncer


def _wait_until_accepting(bouncer: PrivateBouncer) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if bouncer.process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited at start:\n{bouncer.log()}")
        try:
            with psycopg.connect(bouncer.url("postgres"), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start:\n{bouncer.log()}") from None
            time.sleep(0.05)


@contextlib.contextmanager
def running(
    server_url: str, *, pool_mode: str = "transaction", pool_size: int = 2
) -> Iterator[PrivateBouncer]:
    """A private pgbouncer for the length of a `with` block, removed even when the block fails."""
    bouncer = start(server_url, pool_mode=pool_mode, pool_size=pool_size)
    try:
        yield bouncer
    finally:
        bouncer.stop()
