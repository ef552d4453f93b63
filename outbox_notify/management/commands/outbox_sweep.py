"""manage.py outbox_sweep: one publishing pass, for cron."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import CommandError

from outbox_notify.management.commands._common import (
    RELAY_NEEDS,
    OutboxCommand,
    logs_to_stderr,
    reported,
    require_relay_privileges,
)
from outbox_notify.management.commands._relay_options import SWEEP_FLAGS, add_flags, config_from
from outbox_notify.relay.loop import Relay
from outbox_notify.relay.reporting import Tally
from outbox_notify.relay.runner import build_relay, check_reachable, stop_signals


class Command(OutboxCommand):
    """Publish every row that is due now, then exit."""

    help = (
        "Publish everything due now (new rows, due retries, rows freed by a dead relay), then "
        "exit 0. Exits non-zero when PostgreSQL or the broker cannot be reached. Safe to run "
        "beside live relays."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, SWEEP_FLAGS)

    def handle(self, *args: Any, **options: Any) -> None:
        require_relay_privileges()
        with reported(RELAY_NEEDS), logs_to_stderr():
            holder: list[Relay] = []
            tally = Tally()
            # SIGTERM/SIGINT: finish the batch in hand (so nothing it published is sent
            # twice), then stop.
            with stop_signals(holder):
                config = config_from(options, SWEEP_FLAGS)
                relay = build_relay(config, listen=False, wake_fd=None, extra_reporters=[tally])
                holder.append(relay)
                check_reachable(relay)
                try:
                    drained = relay.drain()
                    self.stdout.write(tally.summary())
                    if not drained:
                        raise CommandError(
                            "the broker became unreachable during the sweep; rows left for the next run"
                        )
                finally:
                    relay.announce_stop()  # a signal the drain did not look at again
                    relay.disconnect()
                    relay.publisher.close()
