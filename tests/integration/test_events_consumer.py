"""Consumer.process against the real PostgreSQL: once per event id, rollback, bad input, races."""

from __future__ import annotations

import dataclasses
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from outbox_notify import signals
from outbox_notify.events import Consumer, Envelope
from outbox_notify.events import envelope as wire
from outbox_notify.events.consumer import Outcome, event_type_of
from outbox_notify.exceptions import ConfigurationError
from outbox_notify.models import InboxRecord
from tests import event_consumers
from tests.event_consumers import CardCreated, OrderPlaced, runs
from tests.events_support import SOURCE, envelope_for, raw_envelope
from tests.relay_support import wait_for
from tests.testapp.models import Effect

# transaction=True: the handler's transaction must really commit (or roll back) for the inbox
# to mean anything, and the concurrency test needs two connections that see each other's commits.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def record_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the test handlers record their runs."""
    path = tmp_path / "runs.jsonl"
    monkeypatch.setenv("OUTBOX_TEST_RECORD_FILE", str(path))
    return path


def body(event: Any, event_id: str | None = None) -> bytes:
    return wire.encode(envelope_for(event, event_id=event_id))


def markers() -> list[str]:
    return list(Effect.objects.order_by("id").values_list("marker", flat=True))


def test_an_event_is_handled_once_with_its_id_in_the_consumers_scope() -> None:
    """The handler's effect and the inbox record of the event id commit together."""
    consumer = event_consumers.build("once")
    result = consumer.process(body(OrderPlaced(order_id=1, marker="a"), "ev-1"))
    assert result.outcome is Outcome.HANDLED
    assert (result.event_id, result.event_type) == ("ev-1", event_type_of(OrderPlaced))
    assert markers() == ["a"]
    record = InboxRecord.objects.get()
    assert (record.scope, record.key) == ("events:once", f'["{SOURCE}","ev-1"]')
    assert (record.task_id, record.task_name) == ("ev-1", "tests.event_consumers.OrderPlaced")


def test_a_redelivered_event_is_skipped_logged_and_signalled() -> None:
    """The same id a second time: no handler run, outbox_event_duplicate_skipped sent."""
    consumer = event_consumers.build("dup")
    heard: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        heard.append(kwargs)

    signals.outbox_event_duplicate_skipped.connect(receiver, sender=signals.SENDER)
    try:
        message = body(OrderPlaced(order_id=1, marker="a"))
        outcomes = [consumer.process(message).outcome for _ in range(3)]
    finally:
        signals.outbox_event_duplicate_skipped.disconnect(receiver, sender=signals.SENDER)
    assert outcomes == [Outcome.HANDLED, Outcome.SKIPPED, Outcome.SKIPPED]
    assert markers() == ["a"]
    assert len(heard) == 2
    assert heard[0]["consumer"] == "dup"
    assert heard[0]["scope"] == "events:dup"
    assert heard[0]["event_source"] == SOURCE


def from_source(source: str, event_id: str, marker: str) -> bytes:
    """An OrderPlaced event with this source and id."""
    envelope = envelope_for(OrderPlaced(order_id=1, marker=marker), event_id=event_id)
    return wire.encode(dataclasses.replace(envelope, source=source))


def test_the_same_id_from_two_sources_is_two_events_each_handled_once() -> None:
    """CloudEvents ids are unique within a source: order-42 of billing and of shipping both run."""
    consumer = event_consumers.build("sources")
    billing = from_source("/billing", "order-42", "billing")
    shipping = from_source("https://shipping.example/orders", "order-42", "shipping")
    outcomes = [consumer.process(m).outcome for m in (billing, shipping, billing, shipping)]
    assert outcomes == [Outcome.HANDLED, Outcome.HANDLED, Outcome.SKIPPED, Outcome.SKIPPED]
    assert markers() == ["billing", "shipping"]


LONG_SOURCE = "https://events.example/" + "s" * 300


def test_a_source_and_id_too_long_for_a_key_are_keyed_by_their_digest() -> None:
    """Over 255 characters the key is sha256:<hex> of the pair, still one per source and id."""
    consumer = event_consumers.build("long")
    first, other = (from_source(LONG_SOURCE + tail, "ev-1", tail) for tail in ("a", "b"))
    outcomes = [consumer.process(m).outcome for m in (first, other, first)]
    assert outcomes == [Outcome.HANDLED, Outcome.HANDLED, Outcome.SKIPPED]
    keys = list(InboxRecord.objects.values_list("key", flat=True))
    assert all(k.startswith("sha256:") and len(k) == 71 for k in keys)
    assert len(set(keys)) == 2


@pytest.mark.parametrize("watched", [False, True], ids=["key-with-begin", "key-alone"])
def test_an_id_recorded_alone_before_the_upgrade_is_still_skipped(watched: bool) -> None:
    """A key an earlier release recorded (the id alone) makes the redelivery a duplicate, from
    any source (the documented trade-off, until the key is purged); other ids run."""
    consumer = event_consumers.build("upgrade")
    event_type = event_type_of(OrderPlaced)
    InboxRecord.objects.create(
        scope="events:upgrade", key="ev-old", task_id="ev-old", task_name=event_type
    )
    messages = [
        from_source(SOURCE, "ev-old", "redelivered"),
        from_source("/elsewhere", "ev-old", "same-id-elsewhere"),
        from_source(SOURCE, "ev-new", "new"),
    ]
    with CaptureQueriesContext(connections["default"]) if watched else nullcontext():
        outcomes = [consumer.process(m).outcome for m in messages]
    assert outcomes == [Outcome.SKIPPED, Outcome.SKIPPED, Outcome.HANDLED]
    assert markers() == ["new"]


def test_two_consumers_each_handle_one_event_once() -> None:
    """Different consumer names are different scopes: each runs its handler once."""
    message = body(CardCreated(card="c1"))
    first, second = event_consumers.build("one"), event_consumers.build("two")
    outcomes = [c.process(message).outcome for c in (first, second, first, second)]
    assert outcomes == [Outcome.HANDLED, Outcome.HANDLED, Outcome.SKIPPED, Outcome.SKIPPED]
    assert markers() == ["c1", "c1"]


def test_a_raising_handler_rolls_back_its_effects_and_its_inbox_record(record_file: Path) -> None:
    """FAILED leaves nothing behind, so the next delivery runs the handler again."""
    consumer = event_consumers.build("rollback")
    message = body(OrderPlaced(order_id=1, marker="r", fail_runs=1), "ev-r")
    failed = consumer.process(message)
    assert failed.outcome is Outcome.FAILED
    assert failed.reason == "RuntimeError: r run 1 fails on purpose"
    assert markers() == []
    assert not InboxRecord.objects.exists()
    assert consumer.process(message).outcome is Outcome.HANDLED
    assert list(Effect.objects.values_list("marker", "attempt")) == [("r", 1)]
    assert len(runs(record_file, "ev-r")) == 2


def test_type_strings_and_declared_types_reach_their_handlers() -> None:
    """A class's event_type attribute names its type; a type string's handler gets the Envelope."""
    consumer = event_consumers.build("types")
    card = consumer.process(wire.encode(raw_envelope("library.CardCreated", {"card": "k"})))
    raw = consumer.process(wire.encode(raw_envelope("tests.raw", {"marker": "m"})))
    assert (card.outcome, raw.outcome) == (Outcome.HANDLED, Outcome.HANDLED)
    assert markers() == ["k", "m"]


UNDECODABLE = [
    (b"{not json", "body is not JSON"),
    (b'{"id": "x"}', "missing or non-string attribute(s): specversion, source, type"),
    (wire.encode(raw_envelope("tests.unknown", {})), "has no handler for event type"),
    (
        wire.encode(raw_envelope(event_type_of(OrderPlaced), {"order_id": 1, "colour": "red"})),
        "does not fit OrderPlaced: TypeError: OrderPlaced.__init__() missing 1 required",
    ),
    (b'{"amount": {"__type__": "decimal", "__value__": "abc"}}', "body is not JSON"),
    (b'{"ref": {"__type__": "uuid", "__value__": "x"}}', "body is not JSON"),
    (b"[" * 5000, "body is not JSON"),
    (
        wire.encode(raw_envelope(event_type_of(OrderPlaced), [1, 2])),
        "is a JSON list, not an object for OrderPlaced",
    ),
    (
        wire.encode(raw_envelope("tests.raw", {}, event_id="x" * 300)),
        "the event id must have 1 to 255 characters",
    ),
]


@pytest.mark.parametrize(("message", "reason"), UNDECODABLE)
def test_an_undecodable_message_says_why_and_runs_nothing(message: bytes, reason: str) -> None:
    """Bad JSON, not a CloudEvent, unknown type, data unfit for the class, unstorable id."""
    result = event_consumers.build("bad").process(message)
    assert result.outcome is Outcome.UNDECODABLE
    assert reason in (result.reason or "")
    assert markers() == []
    assert not InboxRecord.objects.exists()


def test_a_fallback_handler_takes_the_types_without_a_handler() -> None:
    """consumer.fallback gets the Envelope of any type that has no handler of its own."""
    consumer = Consumer("fallback", exchange="x")
    seen: list[Envelope] = []
    consumer.fallback(seen.append)
    assert consumer.process(wire.encode(raw_envelope("any.thing", {"n": 1}))).outcome is (
        Outcome.HANDLED
    )
    assert [(e.type, e.data) for e in seen] == [("any.thing", {"n": 1})]


def test_registration_mistakes_fail_at_registration() -> None:
    """A second handler for a type, a non-dataclass, and bad numbers raise ConfigurationError."""
    consumer = Consumer("reg", exchange="x")
    consumer.handler("a.b")(print)
    with pytest.raises(ConfigurationError, match=r"has a handler for 'a\.b' already"):
        consumer.handler("a.b")(print)
    with pytest.raises(ConfigurationError, match="takes a dataclass or a type string"):
        consumer.handler(dict)
    with pytest.raises(ConfigurationError, match="max_attempts and prefetch"):
        Consumer("reg", exchange="x", max_attempts=0)
    with pytest.raises(ConfigurationError, match="consumer's inbox scope must have 1 to 255"):
        Consumer("n" * 250, exchange="x")


def test_the_event_type_rule_is_module_and_qualified_name_unless_declared() -> None:
    """event_type_of: `event_type` attribute, else module.QualName."""

    @dataclasses.dataclass
    class Local:
        n: int

    assert event_type_of(CardCreated) == "library.CardCreated"
    assert event_type_of(Local).endswith(
        "test_events_consumer.test_the_event_type_rule_is_module_and_qualified_name_unless_declared"
        ".<locals>.Local"
    )


def test_two_concurrent_deliveries_one_runs_the_other_waits_then_skips(record_file: Path) -> None:
    """The second delivery blocks on the first one's uncommitted inbox row, then skips."""
    consumer = event_consumers.build("race")
    message = body(OrderPlaced(order_id=1, marker="race", sleep=5.0), "ev-race")
    outcomes: dict[str, Outcome] = {}

    def deliver(name: str) -> None:
        try:
            outcomes[name] = consumer.process(message).outcome
        finally:
            connections.close_all()

    first = threading.Thread(target=deliver, args=("first",))
    first.start()
    wait_for(lambda: runs(record_file, "ev-race"), what="the first handler to start")
    second = threading.Thread(target=deliver, args=("second",))
    second.start()
    assert first.is_alive()  # the second delivery starts while the first holds its row
    first.join(60)
    second.join(60)
    assert outcomes == {"first": Outcome.HANDLED, "second": Outcome.SKIPPED}
    assert len(runs(record_file, "ev-race")) == 1
    assert markers() == ["race"]


@dataclasses.dataclass(frozen=True)
class Validated:
    """An event class that validates its data, as many do."""

    event_type = "tests.validated"
    amount: int

    def __post_init__(self) -> None:
        if self.amount < 0:
            raise ValueError("amount must not be negative")


@dataclasses.dataclass
class WithDerived:
    """An event class with a field computed at construction (asdict() carries it too)."""

    event_type = "tests.derived"
    marker: str
    upper: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.upper = self.marker.upper()


def _handled_markers() -> Consumer:
    consumer = Consumer("typed", exchange="tests-typed")
    consumer.handler(Validated)(lambda event: event_consumers.write_effect(str(event.amount), "v"))
    consumer.handler(WithDerived)(lambda event: event_consumers.write_effect(event.upper, "d"))
    return consumer


def test_a_class_that_refuses_the_data_makes_the_event_undecodable_not_a_crash() -> None:
    """__post_init__ raising ValueError is the data's fault: UNDECODABLE, with the reason."""
    result = _handled_markers().process(
        wire.encode(raw_envelope("tests.validated", {"amount": -1}))
    )
    assert result.outcome is Outcome.UNDECODABLE
    assert "ValueError: amount must not be negative" in (result.reason or "")
    assert markers() == []


def test_fields_the_class_does_not_take_are_ignored() -> None:
    """init=False fields (asdict() includes them) and fields a newer publisher added are dropped."""
    published = dataclasses.asdict(WithDerived(marker="x"))
    assert published == {"marker": "x", "upper": "X"}
    published["added_later"] = 1
    result = _handled_markers().process(wire.encode(raw_envelope("tests.derived", published)))
    assert result.outcome is Outcome.HANDLED, result.reason
    assert markers() == ["X"]


def test_a_handler_that_swallows_a_database_error_is_failed_and_commits_nothing() -> None:
    """atomic() would roll back silently: the run is FAILED, no effect, no inbox record."""
    event_consumers.write_effect("existing", "e")
    consumer = event_consumers.build("swallow")
    result = consumer.process(wire.encode(raw_envelope("tests.swallow", {"marker": "s"})))
    assert result.outcome is Outcome.FAILED
    assert "marked for rollback" in (result.reason or "")
    assert markers() == ["existing"]
    assert not InboxRecord.objects.exists()
