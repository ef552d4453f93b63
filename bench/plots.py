"""The report's PNG plots (matplotlib, Agg backend chosen by the caller)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from bench.tables import writer_label

COLOURS = {"ours": "#1f77b4", "peer": "#d62728"}
WRITER_COLOURS = {
    "ours-no-trigger": "#9ecae1",
    "ours-trigger": "#6baed6",
    "ours": "#1f77b4",
    "peer": "#d62728",
    "ours-rabbitmq": "#08306b",
    "peer-rabbitmq": "#fb6a4a",
}
DPI = 110


def latency_cdf(result: dict[str, Any], sides: dict[str, str], out: Path, broker: str) -> None:
    """One panel per rate: the share of messages that arrived within x ms, x on a log axis."""
    rates = result["rates"]
    fig, axes = plt.subplots(
        1, len(rates), figsize=(4.2 * len(rates), 3.6), sharey=True, squeeze=False
    )
    for ax, rate in zip(axes[0], rates, strict=True):
        for key, label in sides.items():
            row = next((r for r in result["rows"] if r["side"] == key and r["rate"] == rate), None)
            if not row or not row.get("cdf_ms"):
                continue
            points = row["cdf_ms"]
            shown = [
                (max(p, 0.01), (i + 1) / len(points)) for i, p in enumerate(points) if p is not None
            ]
            if shown:
                xs, ys = zip(*shown, strict=True)
                ax.step(xs, ys, where="post", label=label, color=COLOURS[key])
        ax.set_xscale("log")
        ax.set_title(f"{broker}: {rate:,} messages/s")
        ax.set_xlabel("commit → broker (ms, log)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("share of messages")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def _bars(
    ax: Any, groups: list[str], series: list[tuple[str, str, list[float]]], title: str
) -> None:
    """Grouped bars; series are (label, colour, one height per group)."""
    width = 0.8 / max(1, len(series))
    for index, (label, colour, heights) in enumerate(series):
        xs = [g + index * width for g in range(len(groups))]
        bars = ax.bar(xs, heights, width, label=label, color=colour)
        crowded = len(series) > 2
        ax.bar_label(
            bars,
            labels=[f"{h:,.0f}" for h in heights],
            fontsize=6 if crowded else 7,
            rotation=90 if crowded else 0,
            padding=2,
        )
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.18)  # room for the value labels
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _value(rows: list[dict[str, Any]], field: str, **match: Any) -> float:
    found = [r[field] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return float(found[0]) if found else 0.0


def _drain_panel(report: dict[str, Any]) -> Any:
    """Bars per broker and relay count: messages/s of each library."""
    groups: list[str] = []
    heights: dict[str, list[float]] = {k: [] for k in report["sides"]}
    for broker, label in report["brokers"].items():
        entry = report["scenarios"].get(f"drain.{broker}", {})
        if entry.get("status") != "ok":
            continue
        rows = entry["result"]["rows"]
        for n in (1, 2):
            groups.append(f"{label}\n{n} relay{'s' * (n > 1)}")
            for key in report["sides"]:
                heights[key].append(_value(rows, "per_s", side=key, relays=n, batch_size=None))
    if not groups:
        return None
    series = [(label, COLOURS[k], heights[k]) for k, label in report["sides"].items()]
    return groups, series, "drain: messages/s"


def _writers_panel(result: dict[str, Any], sides: dict[str, str]) -> Any:
    rows = result["rows"]
    configs = dict.fromkeys((r["config"], writer_label(r)) for r in rows)
    series = [
        (
            label,
            WRITER_COLOURS.get(key, "grey"),
            [_value(rows, "tps", config=key, writers=w) for w in result["writers"]],
        )
        for key, label in configs
    ]
    groups = [f"{w} writer{'s' * (w > 1)}" for w in result["writers"]]
    return groups, series, "writers: transactions/s"


def _enqueue_panel(result: dict[str, Any], sides: dict[str, str]) -> Any:
    rows = result["rows"]
    series = [
        (
            label,
            COLOURS[k],
            [_value(rows, "rows_per_s", side=k, per_transaction=n) for n in (1, 100)],
        )
        for k, label in sides.items()
    ]
    return ["1 per transaction", "100 per transaction"], series, "enqueue: rows/s"


def _ok(report: dict[str, Any], key: str) -> Any:
    entry = report["scenarios"].get(key, {})
    return entry["result"] if entry.get("status") == "ok" else None


def throughput(report: dict[str, Any], out: Path) -> bool:
    """Bars: drain messages/s (per broker), writer transactions/s, enqueue rows/s.

    Draws whichever ran; False (and no file) when none did.
    """
    sides = report["sides"]
    panels = [_drain_panel(report)]
    for key, make in (("writers", _writers_panel), ("enqueue", _enqueue_panel)):
        result = _ok(report, key)
        panels.append(make(result, sides) if result is not None else None)
    shown = [panel for panel in panels if panel is not None]
    if not shown:
        return False
    widths = [max(5.2, 1.3 * len(groups)) for groups, _, _ in shown]
    fig, axes = plt.subplots(1, len(shown), figsize=(sum(widths), 3.8), squeeze=False)
    for ax, (groups, series, title) in zip(axes[0], shown, strict=True):
        _bars(ax, groups, series, title)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True
