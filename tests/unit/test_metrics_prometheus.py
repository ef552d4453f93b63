"""PrometheusMetrics over real HTTP: names, types, labels, /healthz; the docs use real names."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox_notify import metrics_prometheus
from outbox_notify.metrics import NullMetrics, combined
from outbox_notify.metrics_prometheus import PREFIX, PrometheusMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
TIMEOUT = 5.0  # seconds for one local HTTP request
# The series a histogram or counter family adds to its name in the text format.
SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")


@dataclasses.dataclass
class State:
    """Stands in for a Relay: what /healthz reads."""

    connected: bool = False
    polling: bool = False


@pytest.fixture
def served() -> Iterator[tuple[PrometheusMetrics, str]]:
    """PrometheusMetrics served on a free loopback port; (metrics, base URL)."""
    sink = PrometheusMetrics()
    endpoint = metrics_prometheus.serve(sink, "127.0.0.1", 0)
    try:
        yield sink, f"http://127.0.0.1:{endpoint.port}"
    finally:
        endpoint.close()


def get(url: str) -> tuple[int, str]:
    """(status, body) of a GET, errors included."""
    try:
        # Only http://127.0.0.1 URLs the tests build themselves.
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:  # noqa: S310
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_method_moves_its_metric(served: tuple[PrometheusMetrics, str]) -> None:
    """Each Metrics call shows at /metrics under its Prometheus name, labels and type."""
    sink, base = served
    sink.published("shop.charge", 3)
    sink.published("shop.charge")
    sink.failed("shop.charge")
    sink.dead_lettered("shop.refund", 2)
    sink.deferred(4)
    sink.batch(100, 0.043)
    sink.lag(0.21)
    sink.queue(42, 7.5)
    sink.vacuum(1000, 12.0, 900)
    sink.backlog(30, 8, 4, 2)
    sink.relays(3)
    status, body = get(base + "/metrics")
    assert status == 200
    got = samples(body)
    charge = (("task_name", "shop.charge"),)
    assert got[(PREFIX + "published_total", charge)] == 4
    assert got[(PREFIX + "failed_total", charge)] == 1
    assert got[(PREFIX + "dead_lettered_total", (("task_name", "shop.refund"),))] == 2
    assert got[(PREFIX + "deferred_total", ())] == 4
    assert got[(PREFIX + "batch_size_rows_count", ())] == 1
    assert got[(PREFIX + "batch_size_rows_bucket", (("le", "100.0"),))] == 1
    assert got[(PREFIX + "batch_size_rows_bucket", (("le", "50.0"),))] == 0
    assert got[(PREFIX + "batch_duration_seconds_sum", ())] == pytest.approx(0.043)
    assert got[(PREFIX + "lag_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[(PREFIX + "lag_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[(PREFIX + "queue_depth_rows", ())] == 42
    assert got[(PREFIX + "queue_oldest_seconds", ())] == 7.5
    assert got[(PREFIX + "table_dead_rows", ())] == 1000
    assert got[(PREFIX + "table_oldest_snapshot_seconds", ())] == 12.0
    assert got[(PREFIX + "table_dead_rows_held", ())] == 900
    assert got[(PREFIX + "queue_due_rows", ())] == 30
    assert got[(PREFIX + "queue_held_rows", ())] == 8
    assert got[(PREFIX + "queue_retrying_rows", ())] == 4
    assert got[(PREFIX + "dead_letters_rows", ())] == 2
    assert got[(PREFIX + "relays_listening", ())] == 3


def test_backlog_gauges_are_absent_until_read() -> None:
    """Before the relay's first read, and for dead letters its role may not count, no series:
    an alert must not take a 0 for the truth."""
    sink = PrometheusMetrics()
    names = {
        s.name
        for f in text_string_to_metric_families(sink.exposition().decode())
        for s in f.samples
    }
    assert PREFIX + "queue_held_rows" not in names
    sink.backlog(1, 2, 3, None)
    got = samples(sink.exposition().decode())
    assert got[(PREFIX + "queue_held_rows", ())] == 2
    assert (PREFIX + "dead_letters_rows", ()) not in got


def test_the_names_table_is_what_the_registry_serves() -> None:
    """RELAY_METRICS (what the docs are checked against) lists exactly the served families."""
    sink = PrometheusMetrics()
    sink.backlog(0, 0, 0, 0)  # the backlog gauges show once the relay has read them
    sink.relays(0)
    text = sink.exposition().decode()
    # prometheus_client adds a `_created` timestamp beside each counter and histogram.
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }
    listed = {
        PREFIX + name.removesuffix("_total"): kind
        for name, (kind, _) in metrics_prometheus.RELAY_METRICS.items()
    }
    assert families == listed


def test_task_name_label_is_capped() -> None:
    """Past max_task_names distinct names, new ones are counted under task_name="other"."""
    sink = PrometheusMetrics(max_task_names=2)
    for name in ("a", "b", "c", "d", "a"):
        sink.published(name)
    got = samples(sink.exposition().decode())
    by_label = {labels: v for (n, labels), v in got.items() if n == PREFIX + "published_total"}
    assert by_label == {
        (("task_name", "a"),): 2,
        (("task_name", "b"),): 1,
        (("task_name", "other"),): 2,
    }


def test_healthz_follows_the_relay_state(served: tuple[PrometheusMetrics, str]) -> None:
    """/healthz: 503 before a relay or while disconnected; 200 listening or polling."""
    sink, base = served
    assert get(base + "/healthz") == (503, "disconnected\n")
    state = State()
    sink.state = state
    assert get(base + "/healthz") == (503, "disconnected\n")
    state.connected = True
    assert get(base + "/healthz") == (200, "listening\n")
    state.polling = True
    assert get(base + "/healthz") == (200, "polling\n")
    got = samples(get(base + "/metrics")[1])
    assert got[(PREFIX + "relay_connected", ())] == 1
    assert got[(PREFIX + "relay_listening", ())] == 0
    assert get(base + "/other")[0] == 404


def test_a_port_in_use_is_a_configuration_error(served: tuple[PrometheusMetrics, str]) -> None:
    """A second server on a port already bound fails with the library's own error."""
    sink, base = served
    port = int(base.rsplit(":", 1)[1])
    with pytest.raises(metrics_prometheus.ConfigurationError, match="cannot serve metrics"):
        metrics_prometheus.serve(sink, "127.0.0.1", port)


def test_stats_exposition_parses_as_gauges() -> None:
    """outbox_stats's Prometheus text is valid exposition: one gauge per STATS_GAUGES name."""
    snapshot = SimpleNamespace(
        queue_depth=10,
        due_now=4,
        scheduled=SimpleNamespace(count=5),
        retrying=1,
        dead_letter_count=2,
        oldest_pending_seconds=3.5,
        relays_listening=1,
        claims_open=0,
        notify_queue_usage=0.0,
        dead_rows=7,
        dead_rows_held=6,
    )
    text = metrics_prometheus.stats_exposition(snapshot)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {PREFIX + name for name in metrics_prometheus.STATS_GAUGES}
    assert all(f.type == "gauge" for f in families.values())
    assert families[PREFIX + "queue_held_rows"].samples[0].value == 5
    assert families[PREFIX + "queue_oldest_seconds"].samples[0].value == 3.5


def exported_names() -> set[str]:
    """Every series name the relay's endpoint or outbox_stats --format prometheus writes."""
    families = {PREFIX + n for n in metrics_prometheus.RELAY_METRICS}
    families |= {PREFIX + n for n in metrics_prometheus.STATS_GAUGES}
    series = set(families)
    for name in families:
        base = name.removesuffix("_total")
        series |= {base + suffix for suffix in SERIES_SUFFIXES}
    return series


def used_names(text: str) -> set[str]:
    return set(re.findall(r"\boutbox_notify_[a-z_]+", text))


def test_the_grafana_dashboard_uses_only_exported_metrics() -> None:
    """Every metric a panel of docs/grafana-dashboard.json queries exists."""
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = used_names("\n".join(exprs))
    assert len(used) >= 10
    assert used - exported_names() == set()


def test_the_alert_rules_use_only_exported_metrics() -> None:
    """Every metric an expression of docs/prometheus-alerts.yml uses exists."""
    text = (DOCS / "prometheus-alerts.yml").read_text(encoding="utf-8")
    rules = re.findall(r"^\s+- alert: (\w+)", text, re.MULTILINE)
    assert "OutboxOldestPendingTooOld" in rules
    used = used_names(text)
    assert used - exported_names() == set()


def test_statsd_and_prometheus_together_both_hear_every_call() -> None:
    """combined(): NullMetrics left out; two sinks on are a FanOut that feeds both."""
    first, second = PrometheusMetrics(), PrometheusMetrics()
    assert combined(NullMetrics(), first) is first
    assert isinstance(combined(NullMetrics(), NullMetrics()), NullMetrics)
    both = combined(first, second)
    both.published("shop.charge", 2)
    both.queue(5, 1.0)
    for sink in (first, second):
        got = samples(sink.exposition().decode())
        assert got[(PREFIX + "published_total", (("task_name", "shop.charge"),))] == 2
        assert got[(PREFIX + "queue_depth_rows", ())] == 5
