"""The admin's Outbox dashboard: charts of the relays' samples, the relays, the next held ETAs.

Read-only and bounded: the samples are a day of one row a minute per relay
(outbox_notify_sample_v1, written by relay/samples.py), the held ETAs the next HELD_SHOWN
rows of an index. The page reloads itself every REFRESH seconds (a meta refresh: no
JavaScript); the charts are SVG drawn here (outbox_notify/charts.py).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
from typing import Any

from django.db import connections
from django.utils.safestring import SafeString

from outbox_notify import charts, conf, stats

REFRESH = 15  # seconds between reloads of the page
HELD_SHOWN = 50  # held rows drawn on the timeline
RELAY_SILENT_AFTER = 180.0  # seconds without a sample after which a relay is shown as silent
# (window, bucket) in seconds: the last hour by the minute, the last day by the quarter hour.
WINDOWS = {"hour": (3600, 60), "day": (86_400, 900)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RelayRow:
    """One relay as its last sample describes it."""

    relay: str
    host: str
    pid: int
    mode: str
    last_seen: dt.datetime
    seconds_ago: float
    rate: float
    lag_p99_ms: float | None

    @property
    def silent(self) -> bool:
        return self.seconds_ago > RELAY_SILENT_AFTER

    @property
    def waiting(self) -> str:
        return "listening" if self.mode == "listen" else "polling"


def collect(window: str = "hour") -> dict[str, Any]:
    """Everything the page shows, for the window "hour" or "day"."""
    span, bucket = WINDOWS[window]
    with stats.cursor(connections[conf.database_alias()]) as cur:
        now = stats.scalar(cur, "database_now")
        params = {"window": span, "bucket": bucket}
        cur.execute(stats.queries()["dashboard_series"], params)
        series = cur.fetchall()
        cur.execute(stats.queries()["dashboard_dead_by_task"], params)
        dead = cur.fetchall()
        cur.execute(stats.queries()["dashboard_relays"], {"window": 86_400})
        relays = cur.fetchall()
        cur.execute(stats.queries()["dashboard_next_held"], {"limit": HELD_SHOWN})
        held = cur.fetchall()
    end = now.timestamp()
    return {
        "now": now,
        "window": window,
        "windows": list(WINDOWS),
        "refresh": REFRESH,
        "charts": draw(series, dead, start=end - span, end=end),
        "relays": [relay_row(row, now) for row in relays],
        "held": held,
        "held_timeline": charts.timeline(
            f"Next {HELD_SHOWN} held ETAs",
            [(eta.timestamp(), name) for _, name, eta in held],
            now=end,
        ),
        "samples": len(series),
    }


def relay_row(row: tuple[Any, ...], now: dt.datetime) -> RelayRow:
    relay, host, pid, mode, at, rate, lag = row
    return RelayRow(
        relay=relay,
        host=host,
        pid=pid,
        mode=mode,
        last_seen=at,
        seconds_ago=(now - at).total_seconds(),
        rate=float(rate),
        lag_p99_ms=lag,
    )


def draw(
    rows: list[tuple[Any, ...]], dead: list[tuple[Any, ...]], *, start: float, end: float
) -> list[SafeString]:
    """The charts, in page order, from dashboard_series and dashboard_dead_by_task rows."""
    column: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for bucket, depth, held, retrying, dead_letters, rate, retried, p50, p99 in rows:
        t = float(bucket)
        column["depth"].append((t, float(depth)))
        column["due"].append((t, float(max(depth - held - retrying, 0))))
        column["held"].append((t, float(held)))
        column["retrying"].append((t, float(retrying)))
        column["dead letters"].append((t, float(dead_letters)))
        column["published/s"].append((t, float(rate)))
        column["retried"].append((t, float(retried)))
        if p50 is not None:
            column["p50"].append((t, float(p50)))
            column["p99"].append((t, float(p99)))
    by_task: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for t, task, count in dead:
        by_task[task].append((float(t), float(count)))

    def chart(title: str, names: tuple[str, ...], unit: str = "") -> SafeString:
        lines = [charts.Series(name=n, points=column[n]) for n in names]
        return charts.line_chart(title, lines, start=start, end=end, unit=unit)

    return [
        chart("Queue", ("depth", "due", "held")),
        chart("Publish rate", ("published/s",), unit="messages/s"),
        chart("Commit → broker lag", ("p50", "p99"), unit="ms"),
        chart("Retries", ("retried", "retrying")),
        chart("Dead letters", ("dead letters",)),
        charts.line_chart("Dead-lettered per task", charts.by_name(by_task), start=start, end=end),
    ]
