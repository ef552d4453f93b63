"""Command-line flags shared by outbox_listen and outbox_sweep."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox_notify.exceptions import ConfigurationError
from outbox_notify.management.commands._common import seconds, whole_number
from outbox_notify.relay.config import RelayConfig

SWEEP_FLAGS = (
    "batch_size",
    "max_retries",
    "backoff_time",
    "max_backoff",
    "stale_timeout",
    "send_timeout",
    "log_batches",
)
LISTEN_FLAGS = (
    *SWEEP_FLAGS,
    "sweep_interval",
    "shutdown_timeout",
    "broker_outage_cooldown",
    "liveness_file",
    "poll_only",
    "lock_wait",
)
_DEFAULTS = RelayConfig()

# Each flag's help and value type. The types refuse what is not a valid value on its own
# (a fraction of a row, nan or inf seconds, zero seconds) with a usage error naming the flag;
# RelayConfig still refuses combinations that do not fit together.
_HELP: dict[str, tuple[str, Callable[[str], Any]]] = {
    "batch_size": ("rows claimed and published per batch", whole_number(1)),
    "max_retries": ("ordinary publish failures before a row is dead-lettered", whole_number(0)),
    "backoff_time": (
        "seconds: base delay of the first retry (doubles each time, with jitter)",
        seconds(),
    ),
    "max_backoff": ("seconds: cap on any retry delay", seconds()),
    "stale_timeout": (
        "seconds a hung relay may hold a claim before the server frees its rows",
        seconds(),
    ),
    "send_timeout": ("seconds: bound on one publish (connect, write, confirm)", seconds()),
    "sweep_interval": (
        "seconds between sweeps while idle (missed notifications, freed rows)",
        seconds(),
    ),
    "shutdown_timeout": ("seconds to finish the batch in hand after SIGTERM/SIGINT", seconds()),
    "broker_outage_cooldown": ("seconds to pause after consecutive broker outages", seconds()),
    "lock_wait": (
        "seconds a relay about to sleep queues for the wake lock at a time; while a writer's "
        "open transaction holds it, the relay runs one statement per this interval",
        seconds(),
    ),
}


def add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Add the named flags with RelayConfig's defaults."""
    for name in names:
        flag = "--" + name.replace("_", "-")
        if name == "liveness_file":
            parser.add_argument(
                flag,
                type=Path,
                default=None,
                help="file whose mtime is refreshed while the relay is healthy",
            )
        elif name == "log_batches":
            parser.add_argument(
                flag,
                action="store_true",
                help="log outbox.batch_done (info) for every committed batch",
            )
        elif name == "poll_only":
            parser.add_argument(
                flag, action="store_true", help="never LISTEN: poll every --sweep-interval"
            )
        else:
            text, kind = _HELP[name]
            default = getattr(_DEFAULTS, name)
            parser.add_argument(
                flag, type=kind, default=default, help=f"{text} (default {default})"
            )


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-address (outbox_listen): the Prometheus endpoint."""
    parser.add_argument(
        "--metrics-port",
        type=whole_number(0),
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at /metrics and a probe at /healthz on this port "
        "(0: any free port; default OUTBOX_NOTIFY_METRICS_PORT, else off; needs the "
        "prometheus extra)",
    )
    parser.add_argument(
        "--metrics-address",
        default=None,
        metavar="ADDRESS",
        help="address the metrics port binds (default OUTBOX_NOTIFY_METRICS_ADDRESS, "
        "else 127.0.0.1)",
    )


def config_from(options: dict[str, Any], names: tuple[str, ...]) -> RelayConfig:
    """A RelayConfig from parsed options (only the named flags)."""
    config = RelayConfig(**{name: options[name] for name in names})
    if config.lock_wait > config.sweep_interval:
        # Longer than a sweep interval, it would hold back the wake-ups of writers that commit
        # meanwhile for longer than the sweep is meant to bound them.
        raise ConfigurationError("--lock-wait must not be longer than --sweep-interval")
    return config
