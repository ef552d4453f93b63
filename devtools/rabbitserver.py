"""Private RabbitMQ nodes for fault tests, benchmarks and the chaos suite.

A node started here has its own name, ports, data, log and cookie directories, so it runs
beside the machine's shared RabbitMQ without touching it. Only nodes started here are ever
stopped, frozen, alarmed or killed by our code. RabbitMQ refuses nothing as root, but its
data directory must belong to the user it runs as, so as root it runs as `rabbitmq`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from devtools.pgserver import free_port
from devtools.process import stop_process

SERVER_CANDIDATES = ("/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server")
CTL_CANDIDATES = ("/usr/lib/rabbitmq/bin/rabbitmqctl", "/usr/sbin/rabbitmqctl")
START_TIMEOUT = 90.0  # seconds; a node usually accepts connections within about 10 s
CTL_TIMEOUT = 60.0  # seconds for one rabbitmqctl command
RUN_AS = "rabbitmq"


def _find(candidates: tuple[str, ...], name: str) -> str:
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"{name} is not installed (Debian: apt-get install rabbitmq-server)")


def installed() -> bool:
    """Whether the RabbitMQ server and rabbitmqctl are on this machine."""
    try:
        _find(SERVER_CANDIDATES, "rabbitmq-server")
        _find(CTL_CANDIDATES, "rabbitmqctl")
    except RuntimeError:
        return False
    return True


@dataclass
class PrivateRabbit:
    """A RabbitMQ node of our own on free loopback ports (guest/guest, vhost /)."""

    base: Path
    port: int
    dist_port: int
    node: str
    process: subprocess.Popen[bytes] | None = field(default=None)
    frozen: bool = field(default=False)

    def url(self) -> str:
        """amqp:// URL of this node's default vhost."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start (again) with the same name, ports and data; wait until it takes AMQP."""
        self._prepare()
        argv = [_find(SERVER_CANDIDATES, "rabbitmq-server")]
        if os.geteuid() == 0:
            user = pwd.getpwnam(RUN_AS)
            argv = [
                "setpriv",
                f"--reuid={user.pw_uid}",
                f"--regid={user.pw_gid}",
                "--clear-groups",
                *argv,
            ]
        log = (self.base / "server.out").open("ab")
        self.process = subprocess.Popen(
            argv,
            env=self._env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal to the test's process group leaves it alone
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                why = (
                    "exited"
                    if self.process.poll() is not None
                    else f"no answer in {START_TIMEOUT:.0f} s"
                )
                tail = self.log_tail()
                errors = self.log_errors()
                self.stop()
                raise RuntimeError(
                    f"RabbitMQ node {self.node} (AMQP port {self.port}, distribution port "
                    f"{self.dist_port}) did not start ({why}); its errors:\n{errors}\n"
                    f"its last lines:\n{tail}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the node (thawing it first if frozen); connections to it break."""
        if self.process is None:
            return
        self.thaw()
        with contextlib.suppress(Exception):
            self.ctl("stop", timeout=30)
        stop_process(self.process, timeout=20)
        self._kill_leftovers()
        self.process = None

    def destroy(self) -> None:
        """Stop the node and delete everything it wrote."""
        with contextlib.suppress(Exception):
            self.stop()
        self._kill_leftovers()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- faults ------------------------------------------------------------------------

    def ctl(self, *args: str, timeout: float = CTL_TIMEOUT) -> str:
        """Run one rabbitmqctl command against this node; its output."""
        cookie = (self.base / "home" / ".erlang.cookie").read_text().strip()
        argv = [
            _find(CTL_CANDIDATES, "rabbitmqctl"),
            "-n",
            self.node,
            "--erlang-cookie",
            cookie,
            *args,
        ]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self._env(), check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def memory_alarm(self, on: bool) -> None:
        """Raise (or clear) a memory alarm: the node blocks every publishing connection."""
        if on:
            self.ctl("set_vm_memory_high_watermark", "absolute", "1")
        else:
            self.ctl("set_vm_memory_high_watermark", "0.4")

    def close_all_connections(self, reason: str = "outbox-notify fault test") -> None:
        """Force-close every client connection."""
        self.ctl("close_all_connections", reason)

    def freeze(self) -> None:
        """SIGSTOP the Erlang VM: sockets stay open, nothing answers."""
        for pid in self._beam_pids():
            os.kill(pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT after freeze()."""
        if not self.frozen:
            return
        for pid in self._beam_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = False

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the node wrote (for error messages)."""
        texts = []
        for path in [self.base / "server.out", *sorted((self.base / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                texts.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(texts[-lines:])

    def log_errors(self, lines: int = 20) -> str:
        """The node's lines that report an error (why a boot failed hides above its tail)."""
        found: list[str] = []
        for path in [self.base / "server.out", *sorted((self.base / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                found.extend(
                    line
                    for line in path.read_text(errors="replace").splitlines()
                    if "[error]" in line or "BOOT FAILED" in line or "eaddrinuse" in line
                )
        return "\n".join(found[:lines]) or "(none logged)"

    # -- internals ---------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_"))
        }
        env.update(
            HOME=str(self.base / "home"),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_PID_FILE=str(self.base / "node.pid"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base / "advanced.config"),
        )
        return env

    def _prepare(self) -> None:
        home = self.base / "home"
        for path in (home, self.base / "mnesia", self.base / "log"):
            path.mkdir(parents=True, exist_ok=True)
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "advanced.config").write_text("[].\n")
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            # A disk alarm would block publishers for reasons of this machine, not the test.
            "disk_free_limit.absolute = 1MB\n"
        )
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(uuid.uuid4().hex.upper())
            cookie.chmod(0o400)
        if os.geteuid() == 0:
            user = pwd.getpwnam(RUN_AS)
            for root, dirs, files in os.walk(self.base):
                for name in [*dirs, *files]:
                    os.chown(os.path.join(root, name), user.pw_uid, user.pw_gid)
            os.chown(self.base, user.pw_uid, user.pw_gid)

    def _answers(self) -> bool:
        # The AMQP port opens before the node is ready to serve; a protocol header answered
        # with a connection.start frame means it is.
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock,
        ):
            sock.settimeout(2)
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            return sock.recv(1)[:1] == b"\x01"
        return False

    def _beam_pids(self) -> list[int]:
        """PIDs of this node's Erlang VM (matched by its private home directory)."""
        found = subprocess.run(
            ["pgrep", "-f", "--", f"-home {self.base}/home"],
            capture_output=True,
            text=True,
            check=False,
        )
        pids = []
        for line in found.stdout.split():
            with contextlib.suppress(ValueError, OSError):
                pid = int(line)
                if "beam" in Path(f"/proc/{pid}/comm").read_text():
                    pids.append(pid)
        return pids

    def _kill_leftovers(self) -> None:
        for pid in self._beam_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


START_ATTEMPTS = 3


R = TypeVar("R", bound=PrivateRabbit)


def start(
    kind: type[R] = PrivateRabbit,  # type: ignore[assignment]
    *,
    name: str = "outbox",
    folder: str = "outbox-notify-rabbit-",
    on_failure: Callable[[R], None] | None = None,
) -> R:
    """A fresh node of `kind` on free ports, named `name` and a random suffix, its files in
    a new temporary folder starting with `folder`; the caller must destroy() it.

    A node that stops on its own while booting (a port taken meanwhile, a slow machine) is
    replaced by another on other ports, up to START_ATTEMPTS times; `on_failure` sees each
    failed node before it is destroyed (to keep its log).
    """
    failures: list[str] = []
    for _ in range(START_ATTEMPTS):
        base = Path(tempfile.mkdtemp(prefix=folder))
        base.chmod(0o755)
        server = kind(
            base=base,
            port=free_port(),
            dist_port=free_port(),
            node=f"{name}{uuid.uuid4().hex[:10]}@localhost",
        )
        try:
            server.start()
        except BaseException as exc:
            if on_failure is not None:
                on_failure(server)
            server.destroy()
            if not isinstance(exc, RuntimeError):
                raise
            failures.append(str(exc))
            continue
        return server
    raise RuntimeError(
        f"no RabbitMQ node started in {START_ATTEMPTS} attempts:\n" + "\n\n".join(failures)
    )


@contextlib.contextmanager
def running() -> Iterator[PrivateRabbit]:
    """A private RabbitMQ node for the length of a `with` block, removed even on failure."""
    server = start()
    try:
        yield server
    finally:
        server.destroy()


if __name__ == "__main__":
    # Smoke check: start, raise and clear an alarm, stop.
    started = time.monotonic()
    with running() as node:
        print(node.url(), f"up in {time.monotonic() - started:.1f} s")
        node.memory_alarm(True)
        node.memory_alarm(False)
        node.close_all_connections()
        print("ctl ok")
