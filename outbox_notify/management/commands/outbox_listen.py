"""manage.py outbox_listen: the relay daemon."""

from __future__ import annotations

import argparse
from typing import Any

from outbox_notify.management.commands._common import (
    RELAY_NEEDS,
    OutboxCommand,
    reported,
    require_relay_privileges,
)
from outbox_notify.management.commands._relay_options import (
    LISTEN_FLAGS,
    add_flags,
    add_metrics_flags,
    config_from,
)
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.runner import (
    build_relay,
    check_reachable,
    index_keeper,
    prometheus_endpoint,
    stop_signals,
)


class Command(OutboxCommand):
    """Relay committed outbox rows to the broker, woken by LISTEN/NOTIFY."""

    help = (
        "Run the outbox relay: LISTEN for new rows, claim them with SKIP LOCKED, publish them "
        "and delete them. Exits 0 after SIGTERM/SIGINT once the batch in hand is done."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, LISTEN_FLAGS)
        add_metrics_flags(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        require_relay_privileges()
        with reported(RELAY_NEEDS):
            config = config_from(options, LISTEN_FLAGS)
            holder: list[Relay] = []
            port, address = options["metrics_port"], options["metrics_address"]
            with stop_signals(holder) as wake_fd, prometheus_endpoint(port, address) as exporter:
                relay = build_relay(
                    config, listen=not config.poll_only, wake_fd=wake_fd, extra_metrics=exporter
                )
                if exporter is not None:
                    exporter.state = relay  # /healthz: 503 until connected
                holder.append(relay)
                check_reachable(relay)
                with index_keeper(relay):
                    relay.run()
