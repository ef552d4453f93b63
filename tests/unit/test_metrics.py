"""DogStatsdMetrics against a real UDP socket: names, types, tags, the cardinality cap."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from django.test import override_settings

from outbox_notify import metrics

TIMEOUT = 5.0  # seconds to wait for a packet that should come


@pytest.fixture
def udp() -> Iterator[socket.socket]:
    """A UDP socket on 127.0.0.1 standing in for the DogStatsd agent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(TIMEOUT)
    yield sock
    sock.close()


def receive(sock: socket.socket, count: int) -> list[str]:
    """The next `count` metric lines received (a packet may carry several lines).

    A container id field (`|c:...`, which DogStatsd adds when it runs inside a container) is
    dropped, so the tests read the same inside and outside containers.
    """
    lines: list[str] = []
    while len(lines) < count:
        lines += sock.recv(65535).decode().splitlines()
    return ["|".join(f for f in line.split("|") if not f.startswith("c:")) for line in lines]


def nothing_more(sock: socket.socket) -> bool:
    """True when no further packet arrives shortly."""
    sock.settimeout(0.2)
    try:
        sock.recv(65535)
    except TimeoutError:
        return True
    return False


def settings_for(sock: socket.socket, **extra: Any) -> dict[str, Any]:
    """Django settings pointing the metrics at this socket."""
    return {
        "OUTBOX_NOTIFY_STATSD_HOST": "127.0.0.1",
        "OUTBOX_NOTIFY_STATSD_PORT": sock.getsockname()[1],
        **extra,
    }


def close(sink: metrics.Metrics) -> None:
    """Close a DogStatsd sink's socket (an unclosed socket is a ResourceWarning)."""
    if isinstance(sink, metrics.DogStatsdMetrics):
        sink.close()


@pytest.fixture
def sink(udp: socket.socket) -> Iterator[metrics.Metrics]:
    """from_settings() configured for the test socket."""
    with override_settings(**settings_for(udp)):
        created = metrics.from_settings()
    yield created
    close(created)


def test_from_settings_is_null_without_a_host() -> None:
    """Metrics are off unless OUTBOX_NOTIFY_STATSD_HOST is set."""
    with override_settings(OUTBOX_NOTIFY_STATSD_HOST=None):
        assert isinstance(metrics.from_settings(), metrics.NullMetrics)


def test_every_metric_has_its_documented_name_type_and_tags(
    udp: socket.socket, sink: metrics.Metrics
) -> None:
    """Each Metrics call sends the name, type and tags docs/reference-metrics.md lists."""
    assert isinstance(sink, metrics.DogStatsdMetrics)
    sink.published("tests.add", 3)
    sink.failed("tests.add")
    sink.dead_lettered("tests.add", 2)
    sink.deferred(4)
    sink.batch(10, 0.25)
    sink.lag(1.5)
    sink.queue(42, 7.5)
    assert receive(udp, 9) == [
        "outbox_notify.published:3|c|#task_name:tests.add",
        "outbox_notify.failed:1|c|#task_name:tests.add",
        "outbox_notify.dead_lettered:2|c|#task_name:tests.add",
        "outbox_notify.deferred:4|c",
        "outbox_notify.batch.size:10|h",
        "outbox_notify.batch.duration:0.25|d",
        "outbox_notify.lag:1.5|d",
        "outbox_notify.queue.depth:42|g",
        "outbox_notify.queue.oldest_seconds:7.5|g",
    ]


def test_prefix_and_constant_tags_come_from_settings(udp: socket.socket) -> None:
    """OUTBOX_NOTIFY_STATSD_PREFIX prefixes every name; _TAGS are added to every metric."""
    with override_settings(
        **settings_for(
            udp, OUTBOX_NOTIFY_STATSD_PREFIX="myapp", OUTBOX_NOTIFY_STATSD_TAGS=["env:test"]
        )
    ):
        sink = metrics.from_settings()
    sink.deferred(1)
    sink.published("tests.add")
    close(sink)
    assert receive(udp, 2) == [
        "myapp.outbox_notify.deferred:1|c|#env:test",
        "myapp.outbox_notify.published:1|c|#task_name:tests.add,env:test",
    ]


def test_task_name_tags_are_capped_then_other(udp: socket.socket) -> None:
    """Past the cap, new task names are tagged 'other'; names already seen keep their tag."""
    from datadog.dogstatsd.base import DogStatsd

    client = DogStatsd(host="127.0.0.1", port=udp.getsockname()[1], disable_telemetry=True)
    sink = metrics.DogStatsdMetrics(client, max_task_names=2)
    for name in ("a", "b", "c", "a", "d"):
        sink.published(name)
    sink.close()
    assert [line.rsplit(":", 1)[1] for line in receive(udp, 5)] == ["a", "b", "other", "a", "other"]


def test_default_cap_is_one_hundred_names() -> None:
    """By default the first 100 distinct task names are kept as tags."""
    tags = metrics.TaskNameTags(metrics.DogStatsdMetrics.MAX_TASK_NAMES)
    assert [tags.tag(f"t{n}") for n in range(101)][-2:] == ["task_name:t99", "task_name:other"]


def test_task_names_are_sanitised_for_the_statsd_protocol(
    udp: socket.socket, sink: metrics.Metrics
) -> None:
    """Characters that would break a DogStatsd line (| , # space) become underscores."""
    sink.published("weird|name,with #chars")
    assert receive(udp, 1) == ["outbox_notify.published:1|c|#task_name:weird_name_with__chars"]


def test_a_failing_client_never_raises() -> None:
    """Whatever the client raises, the relay's metric call returns normally."""

    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise OSError("agent gone")

    sink = metrics.DogStatsdMetrics(Exploding())
    sink.published("t")
    sink.batch(1, 0.1)
    sink.queue(1, 1.0)


def test_unreachable_agent_never_raises(udp: socket.socket) -> None:
    """Sending to a port nobody listens on is silent (UDP), and nothing is raised."""
    port = udp.getsockname()[1]
    udp.close()
    with override_settings(OUTBOX_NOTIFY_STATSD_HOST="127.0.0.1", OUTBOX_NOTIFY_STATSD_PORT=port):
        sink = metrics.from_settings()
    for _ in range(3):
        sink.published("t")
    close(sink)


def test_missing_datadog_package_degrades_to_null_with_a_warning(
    udp: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a host set but no datadog package, metrics are off and a warning event says why."""
    monkeypatch.setitem(sys.modules, "datadog", None)
    monkeypatch.setitem(sys.modules, "datadog.dogstatsd", None)
    monkeypatch.setitem(sys.modules, "datadog.dogstatsd.base", None)
    with override_settings(**settings_for(udp)), structlog.testing.capture_logs() as logs:
        sink = metrics.from_settings()
    assert isinstance(sink, metrics.NullMetrics)
    assert [(e["event"], e["log_level"]) for e in logs] == [("outbox.metrics_disabled", "warning")]
    sink.published("t")
    assert nothing_more(udp)
