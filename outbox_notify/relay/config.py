"""The relay's configuration: one frozen value object built by the management commands."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from outbox_notify.exceptions import ConfigurationError

LISTEN_CHANNEL = "outbox_notify_v1"
PROBE_CHANNEL = "outbox_notify_v1_probe"
# The advisory lock a sleeping relay holds; sql/install.sql's trigger tries it in shared mode.
WAKE_LOCK = (1869968482, 1)
LISTEN_APPLICATION_NAME = "outbox_notify.listen"
CLAIM_APPLICATION_NAME = "outbox_notify.claim"
# One broker step (a publish, a batch's pipeline, a declaration) writes within --send-timeout
# and gets its reply or publisher confirms within another --send-timeout.
SEND_TIMEOUTS_PER_STEP = 2
# Every broker step of a batch must end within this share of --stale-timeout after the claim
# began; the rest is left for the finalising round trip, before the server's
# idle_in_transaction_session_timeout could end the claim.
PUBLISH_SHARE = 0.9
# One step's worst case must fit in this share, so the first step still fits when claiming
# and preparing the batch took up to the difference (10 % of --stale-timeout).
FIRST_STEP_SHARE = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """How one relay process behaves; every duration is in seconds."""

    batch_size: int = 100
    sweep_interval: float = 2.0  # seconds between sweeps while idle
    max_retries: int = 5
    backoff_time: float = 1.0  # seconds: base delay of the first retry
    max_backoff: float = 300.0  # seconds: cap of any retry delay
    stale_timeout: float = 30.0  # seconds a claim may sit idle before the server drops it
    send_timeout: float = 10.0  # seconds: bound on one publish (connect, write, confirm)
    shutdown_timeout: float = 10.0  # seconds to finish the batch in hand after SIGTERM
    broker_outage_cooldown: float = 5.0  # seconds the breaker stays open
    breaker_threshold: int = 3  # consecutive outages that open the breaker
    liveness_file: Path | None = None
    poll_only: bool = False
    log_batches: bool = False  # an info line per committed batch (off: none, not even debug)
    lock_wait: float = 0.05  # seconds a relay queues for the wake lock before draining again
    inflight_recheck: float = 0.5  # seconds: re-check rows another relay holds
    liveness_interval: float = 5.0  # seconds between liveness touches while blocked

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigurationError("--batch-size must be at least 1")
        if self.max_retries < 0:
            raise ConfigurationError("--max-retries must be 0 or more")
        for name in (
            "sweep_interval",
            "backoff_time",
            "max_backoff",
            "stale_timeout",
            "send_timeout",
            "shutdown_timeout",
            "broker_outage_cooldown",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(
                    f"--{name.replace('_', '-')} must be a positive number of seconds"
                )
        if self.step_worst_case > self.stale_timeout * FIRST_STEP_SHARE:
            minimum = SEND_TIMEOUTS_PER_STEP / FIRST_STEP_SHARE
            raise ConfigurationError(
                f"--stale-timeout ({self.stale_timeout:g} s) is too short for --send-timeout "
                f"({self.send_timeout:g} s): one publish may take --send-timeout to write and "
                f"--send-timeout again for its reply or confirms, and must fit in "
                f"{FIRST_STEP_SHARE:.0%} of --stale-timeout, so --stale-timeout must be at least "
                f"{minimum:g} x --send-timeout ({self.send_timeout * minimum:g} s)"
            )
        if self.stale_timeout <= self.sweep_interval:
            # A sleeping relay must speak within --stale-timeout or the server ends its session.
            raise ConfigurationError("--stale-timeout must be longer than --sweep-interval")

    @property
    def publish_budget(self) -> float:
        """Seconds after its claim by which a batch's last broker step must have ended."""
        return self.stale_timeout * PUBLISH_SHARE

    @property
    def step_worst_case(self) -> float:
        """Seconds one broker step may take at worst (write, then reply or confirms)."""
        return self.send_timeout * SEND_TIMEOUTS_PER_STEP
