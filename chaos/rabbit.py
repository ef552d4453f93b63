"""The chaos run's private RabbitMQ node, and what the run reads from it.

The node is a devtools.rabbitserver node (its own name, ports, data, log and cookie
directories; never the machine's shared RabbitMQ) with two additions:

- the firehose tracer is on from boot (`trace_vhosts` in its advanced.config), so every
  publish the node receives and every delivery it makes is copied to `amq.rabbitmq.trace`,
  with no gap after a restart (`rabbitmqctl trace_on` does not survive one);
- a user of its own with a random password, so the run can check that no log shows it.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import quote

from devtools import rabbitserver

VHOST = "/"
TRACE_CONFIG = '[{rabbit, [{trace_vhosts, [<<"/">>]}]}].\n'
TIMEOUT = 5.0  # seconds for the run's own AMQP connections to connect or hear back


class TracedRabbit(rabbitserver.PrivateRabbit):
    """A private node whose firehose tracer is on from boot, restarts included."""

    def _prepare(self) -> None:
        super()._prepare()
        # Written after devtools' own (empty) advanced.config, at every start.
        (self.base / "advanced.config").write_text(TRACE_CONFIG)


class ChaosRabbit:
    """The run's node and its user; faults act on `node`, clients use `url()`."""

    def __init__(self, node: TracedRabbit, user: str, password: str, log_dir: Path) -> None:
        self.node = node
        self.user = user
        self.password = password
        self.log_dir = log_dir

    def url(self) -> str:
        """amqp:// URL of the node's default vhost as the run's user, password included."""
        return (
            f"amqp://{self.user}:{quote(self.password, safe='')}@127.0.0.1:{self.node.port}/"
            f"{quote(VHOST, safe='')}"
        )

    def connect(self) -> Any:
        """An open py-amqp connection (kombu's own AMQP client) with short timeouts."""
        import amqp

        conn = amqp.Connection(
            host=f"127.0.0.1:{self.node.port}",
            userid=self.user,
            password=self.password,
            virtual_host=VHOST,
            connect_timeout=TIMEOUT,
            read_timeout=TIMEOUT,
            write_timeout=TIMEOUT,
        )
        conn.connect()
        return conn

    def messages(self, queues: list[str]) -> int:
        """Messages ready or unacknowledged in these queues (rabbitmqctl: authoritative, slow)."""
        out = self.node.ctl("list_queues", "-q", "--no-table-headers", "name", "messages")
        total = 0
        for line in out.splitlines():
            name, _, count = line.strip().rpartition("\t")
            if name in queues and count.isdigit():
                total += int(count)
        return total

    def destroy(self) -> None:
        """Keep the node's log beside the run's others, then stop it and delete its files."""
        _keep_log(self.node, self.log_dir)
        self.node.destroy()


def _keep_log(node: TracedRabbit, log_dir: Path) -> None:
    with contextlib.suppress(OSError):
        for path in sorted((node.base / "log").glob("*.log")):
            (log_dir / f"rabbitmq-{path.name}").write_bytes(path.read_bytes())


def start(log_dir: Path) -> ChaosRabbit:
    """A fresh traced node on free ports with a user of the run's own; destroy() it after."""
    node = rabbitserver.start(
        TracedRabbit,
        name="chaos",
        folder="outbox-notify-chaos-rabbit-",
        on_failure=lambda failed: _keep_log(failed, log_dir),
    )  # a node that stops while booting is replaced (devtools.rabbitserver.START_ATTEMPTS)
    try:
        user, password = "chaos", "rabbit-" + secrets.token_hex(8)
        node.ctl("add_user", user, password)
        node.ctl("set_permissions", "-p", VHOST, user, ".*", ".*", ".*")
    except BaseException:
        _keep_log(node, log_dir)
        node.destroy()
        raise
    return ChaosRabbit(node, user, password, log_dir)
