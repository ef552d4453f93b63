"""Pure decisions of the publishing side: culprit isolation, confirms, deadlines, flags."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from outbox_notify.exceptions import BrokerUnavailable, ConfigurationError
from outbox_notify.relay.amqp_publisher import _Batch
from outbox_notify.relay.config import RelayConfig
from outbox_notify.relay.isolation import Isolation
from outbox_notify.relay.outcome import OutcomePolicy
from outbox_notify.relay.publisher import (
    Attempt,
    PublishDeadline,
    Result,
    broker_refuses_writes,
    is_break,
    may_start,
)
from outbox_notify.relay.store import ClaimedRow
from outbox_notify.relay.timing import Backoff


class Row:
    """The part of an OutgoingMessage the isolation reads."""

    def __init__(self, row_id: int) -> None:
        self.row = type("R", (), {"id": row_id})()


def batch(*ids: int) -> list[Any]:
    return [Row(i) for i in ids]


def test_nothing_suspected_means_one_group() -> None:
    """Without a past break, a batch goes out as one group, in order."""
    assert Isolation().plan(batch(1, 2, 3)) == [[0, 1, 2]]


def test_a_broken_group_is_halved_after_the_others() -> None:
    """Suspects follow the unsuspected messages, in halving groups."""
    isolation = Isolation()
    assert not isolation.broke([2, 3, 4, 5, 6])
    assert isolation.plan(batch(1, 2, 3, 4, 5, 6, 7)) == [[0, 6], [1, 2, 3], [4], [5]]


def test_bisection_converges_on_the_culprit_and_blames_it_alone() -> None:
    """Simulated sends: only the message that breaks every send it is in is failed."""
    isolation = Isolation()
    ids = list(range(1, 42))
    culprit, failed, published = 21, [], set()
    pending = list(ids)
    for _ in range(30):
        if not pending:
            break
        messages = batch(*pending)
        for group in isolation.plan(messages):
            sent = [pending[i] for i in group]
            if culprit in sent:
                if isolation.broke(sent):
                    failed.append(sent[0])
                break
            published.update(sent)
            isolation.cleared(sent)
        pending = [i for i in ids if i not in published and i not in failed]
    assert failed == [culprit]
    assert published == set(ids) - {culprit}


def test_one_lone_break_is_not_enough_to_blame() -> None:
    """A message alone on a connection that broke once (a crash, say) is not failed."""
    isolation = Isolation()
    assert not isolation.broke([7])
    assert isolation.broke([7])


def test_a_big_group_breaking_twice_blames_nobody() -> None:
    """Breaks of whole groups (an outage) never fail anyone by themselves."""
    isolation = Isolation()
    for _ in range(5):
        assert not isolation.broke([1, 2, 3])


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError("timed out"), False),
        (ConnectionRefusedError(111, "refused"), False),
        (BrokerUnavailable("cannot connect"), False),
        (OSError("basic_publish: timed out"), False),
        (type("ConnectionForced", (Exception,), {"reply_code": 320})(), False),
        (type("TimeoutError", (Exception,), {})(), False),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (OSError("Server unexpectedly closed connection"), True),
        (type("FrameError", (Exception,), {"reply_code": 501})(), True),
    ],
)
def test_only_a_connection_broken_by_what_was_sent_is_a_break(
    exc: BaseException, expected: bool
) -> None:
    """Timeouts, refusals and operator closes never make a message a suspect."""
    assert is_break(exc) is expected


def test_nacks_and_full_memory_are_refusals_of_everyone() -> None:
    """basic.nack and Redis OOM are back-pressure: an outage."""
    assert broker_refuses_writes(type("MessageNacked", (Exception,), {})())
    assert broker_refuses_writes(Exception("OOM command not allowed when used memory > x"))
    assert not broker_refuses_writes(Exception("NOT_FOUND - no exchange"))


def test_a_refusal_inside_a_redis_pipeline_is_found_behind_the_command() -> None:
    """redis-py 4.5 raises OOM as a ResponseError prefixed with the (long) pipeline command."""
    queue = "outbox-" + "q" * 60
    annotated = (
        f"Command # 1 (LLEN {queue}) of pipeline caused error: "
        "OOM command not allowed when used memory > 'maxmemory'."
    )
    assert broker_refuses_writes(Exception(annotated))
    assert not broker_refuses_writes(
        Exception(f"Command # 1 (LPUSH {queue}) of pipeline caused error: WRONGTYPE Operation")
    )


def _sent(count: int) -> _Batch:
    message = type("M", (), {"body": b"b", "properties": {"application_headers": {"id": "t"}}})
    return _Batch(
        first_tag=10,
        sent=[(i, "", "q", message()) for i in range(count)],
        results=[None] * count,
        open=count,
    )


def test_confirms_settle_each_tag_including_multiple_and_nacks() -> None:
    """ack multiple settles everything up to its tag; a nack is an outage; late tags ignored."""
    sent = _sent(5)
    sent.settle(11, multiple=True, nacked=False)
    sent.settle(13, multiple=False, nacked=True)
    sent.settle(3, multiple=True, nacked=False)  # an abandoned group's tag
    sent.settle(14, multiple=True, nacked=False)
    results = [r.result if r else None for r in sent.results]
    assert results == [
        Result.PUBLISHED,
        Result.PUBLISHED,
        Result.PUBLISHED,
        Result.OUTAGE,
        Result.PUBLISHED,
    ]
    assert sent.open == 0


def test_a_returned_message_fails_when_its_ack_comes() -> None:
    """basic.return, then the ack: unroutable, an ordinary failure of that message only."""
    sent = _sent(2)
    returned = type("M", (), {"body": b"b", "properties": {"application_headers": {"id": "t"}}})()
    sent.on_return("NO_ROUTE", "", "q", returned)
    sent.settle(11, multiple=True, nacked=False)
    assert sent.results[0] == Attempt(Result.FAILED, sent.returned[0])
    assert sent.results[1] == Attempt(Result.PUBLISHED)
    assert "unroutable" in sent.returned[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_step_may_start_only_if_its_worst_case_ends_in_time() -> None:
    """The claim's budget and a stop's grace period both bound a step's end, not its start."""
    clock, stop = Clock(), [None]
    deadline = PublishDeadline(clock=clock, claim_end=124.0, stop_end=lambda: stop[0])
    assert deadline.allows(20.0)
    clock.now = 104.5
    assert not deadline.allows(20.0)
    assert not deadline()
    stop[0] = 106.0  # type: ignore[call-overload]
    assert deadline.allows(1.0)
    assert not deadline.allows(2.0)
    assert may_start(lambda: False, 1e9)


def test_flags_that_let_a_publish_outlive_its_claim_are_refused() -> None:
    """--stale-timeout must leave 2 x --send-timeout within its 80 %, and says so."""
    RelayConfig(stale_timeout=25.0, send_timeout=10.0)
    with pytest.raises(ConfigurationError, match=r"--stale-timeout.*--send-timeout.*25 s"):
        RelayConfig(stale_timeout=24.0, send_timeout=10.0)


def _row(row_id: int, retries: int = 0) -> ClaimedRow:
    now = dt.datetime.now(dt.UTC)
    return ClaimedRow(row_id, "t", "n", "[]", "{}", "{}", "{}", retries, 1, now)


def test_outcome_policy_spends_retries_on_failures_only() -> None:
    """OUTAGE leaves a row untouched every time; FAILED retries, then dead-letters."""
    policy = OutcomePolicy(RelayConfig(max_retries=2), Backoff(1.0, 10.0))
    for _ in range(5):
        decided = policy.decide([(_row(1), Attempt(Result.OUTAGE, "blocked"))], [])
        assert not decided.retried
        assert not decided.dead
        assert decided.outages == 1
    decided = policy.decide(
        [(_row(1), Attempt(Result.FAILED, "x")), (_row(2, 1), Attempt(Result.FAILED, "y"))], []
    )
    assert [r.id for _, r in decided.retried] == [1]
    assert [d.id for _, d in decided.dead] == [2]


def test_the_smallest_allowed_stale_timeout_still_publishes_after_a_slow_claim() -> None:
    """At --stale-timeout = 2.5 x --send-timeout a step still fits after a 0.4 s claim."""
    config = RelayConfig(stale_timeout=5.0, send_timeout=2.0)
    clock = Clock()
    started = clock.now
    clock.now += 0.4  # claiming and preparing the batch took 8 % of --stale-timeout
    deadline = PublishDeadline(
        clock=clock, claim_end=started + config.publish_budget, stop_end=lambda: None
    )
    assert deadline.allows(config.step_worst_case)
    clock.now += config.step_worst_case
    assert not deadline.allows(config.step_worst_case)
