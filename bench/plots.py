"""The report's PNG plots (matplotlib, Agg backend chosen by the caller)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

COLOURS = {"ours": "#1f77b4", "peer": "#d62728"}
DPI = 110


def latency_cdf(result: dict[str, Any], sides: dict[str, str], out: Path) -> None:
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
            share = [(i + 1) / len(points) for i in range(len(points))]
            ax.step(
                [max(p, 0.01) for p in points], share, where="post", label=label, color=COLOURS[key]
            )
        ax.set_xscale("log")
        ax.set_title(f"{rate:,} messages/s")
        ax.set_xlabel("commit → broker (ms, log)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("share of messages")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def _bars(
    ax: Any, groups: list[str], values: dict[str, list[float]], sides: dict[str, str], title: str
) -> None:
    width = 0.8 / max(1, len(values))
    for index, (key, heights) in enumerate(values.items()):
        xs = [g + index * width for g in range(len(groups))]
        bars = ax.bar(xs, heights, width, label=sides[key], color=COLOURS[key])
        ax.bar_label(bars, labels=[f"{h:,.0f}" for h in heights], fontsize=7)
    ax.set_xticks([g + width * (len(values) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)


def throughput(scenarios: dict[str, Any], sides: dict[str, str], out: Path) -> None:
    """Bars: drain messages/s, writer transactions/s, enqueue rows/s (whichever ran)."""
    panels = []
    if scenarios.get("drain", {}).get("status") == "ok":
        rows = scenarios["drain"]["result"]["rows"]
        groups = ["1 relay", "2 relays"]
        values = {
            k: [
                next((r["per_s"] for r in rows if r["side"] == k and r["relays"] == n), 0.0)
                for n in (1, 2)
            ]
            for k in sides
        }
        panels.append((groups, values, "drain: messages/s"))
    if scenarios.get("enqueue", {}).get("status") == "ok":
        rows = scenarios["enqueue"]["result"]["rows"]
        groups = ["1 per transaction", "100 per transaction"]
        values = {
            k: [
                next(
                    (r["rows_per_s"] for r in rows if r["side"] == k and r["per_transaction"] == n),
                    0.0,
                )
                for n in (1, 100)
            ]
            for k in sides
        }
        panels.append((groups, values, "enqueue: rows/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (groups, values, title) in zip(axes[0], panels, strict=True):
        _bars(ax, groups, values, sides, title)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
