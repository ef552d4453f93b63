"""Decides how each message of a batch ends: published, retried, dead, or left alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.publisher import Attempt, Result
from outbox_notify.relay.store import ClaimedRow, Dead, Outcome, Retry
from outbox_notify.relay.timing import Backoff


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decided:
    """A batch's outcome with the rows behind each list, for signals, metrics and logs."""

    outcome: Outcome
    published: list[ClaimedRow]
    retried: list[tuple[ClaimedRow, Retry]]
    dead: list[tuple[ClaimedRow, Dead]]
    outages: int
    skipped: int
    outage_error: str | None = None


class OutcomePolicy:
    """Turns publish attempts into row outcomes (retries, backoff, dead letters).

    Only a FAILED attempt spends a retry: the publishers return it only when the broker
    refused that message while accepting others (relay/isolation.py finds a message whose own
    send breaks the connection). An OUTAGE never spends one, however often it happens.
    """

    def __init__(self, config: RelayConfig, backoff: Backoff) -> None:
        self.config = config
        self.backoff = backoff

    def decide(
        self,
        attempts: Sequence[tuple[ClaimedRow, Attempt]],
        undecodable: Sequence[tuple[ClaimedRow, str]],
    ) -> Decided:
        """The outcome of one batch."""
        published: list[ClaimedRow] = []
        retried: list[tuple[ClaimedRow, Retry]] = []
        dead = [
            (row, Dead(id=row.id, retries=row.retries, reason=f"undecodable: {why}"))
            for row, why in undecodable
        ]
        outages = skipped = 0
        outage_error = None
        for row, attempt in attempts:
            result = attempt.result
            if result is Result.PUBLISHED:
                published.append(row)
            elif result is Result.FAILED:
                self._fail(row, attempt.error or "unknown error", retried, dead)
            elif result is Result.OUTAGE:
                outages += 1
                outage_error = outage_error or attempt.error
            else:
                skipped += 1
        outcome = Outcome(
            published=[r.id for r in published],
            retry=[r for _, r in retried],
            dead=[d for _, d in dead],
        )
        return Decided(
            outcome=outcome,
            published=published,
            retried=retried,
            dead=dead,
            outages=outages,
            skipped=skipped,
            outage_error=outage_error,
        )

    def _fail(
        self,
        row: ClaimedRow,
        error: str,
        retried: list[tuple[ClaimedRow, Retry]],
        dead: list[tuple[ClaimedRow, Dead]],
    ) -> None:
        attempts_made = row.retries + 1
        # CONTRACT: dead-lettered after --max-retries ordinary failures (0 counts as 1).
        if attempts_made >= max(self.config.max_retries, 1):
            reason = f"publish failed {attempts_made} times; last error: {error}"
            dead.append((row, Dead(id=row.id, retries=attempts_made, reason=reason)))
            return
        delay = self.backoff.delay(row.retries)
        retried.append((row, Retry(id=row.id, retries=attempts_made, delay=delay, error=error)))
