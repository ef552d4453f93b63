"""Turns a results report into Markdown tables, PNG plots and docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import enqueue, headline, tables

SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any], dict[str, str]], str]], ...] = (
    ("latency", "Latency: commit to broker", tables.latency),
    ("drain", "Drain throughput", tables.drain),
    ("writers", "Writer concurrency", tables.writers),
    ("idle", "Idle cost", tables.idle),
    ("crash", "Crash recovery", tables.crash),
    ("enqueue", "Enqueue cost", tables.enqueue),
    ("delay", "One delay(): ours, the peer and a plain Celery publish", enqueue.table),
    ("ceiling", "Ceiling: publishing to Redis without a database", tables.ceiling),
    ("profile", "Where our relay's time goes (py-spy, drain of one relay)", tables.profile),
)
IMAGES = {"latency": "latency_cdf.png", "drain": "throughput.png"}


def _section(report: dict[str, Any], key: str, title: str, render: Any, level: str) -> str:
    entry = report["scenarios"].get(key)
    if entry is None:
        return ""
    head = f"{level} {title}\n\n"
    if entry["status"] != "ok":
        last = entry["error"].strip().splitlines()[-1]
        return head + f"Failed: `{last}`\n"
    return head + render(entry["result"], report["sides"]) + "\n"


def text(report: dict[str, Any]) -> str:
    """Every table, for the terminal."""
    parts = [_section(report, key, title, render, "##") for key, title, render in SECTIONS]
    return "\n".join(p for p in parts if p)


def write_docs(report: dict[str, Any], docs: Path, images: Path) -> None:
    """docs/benchmarks.md and its plots."""
    images.mkdir(parents=True, exist_ok=True)
    made = plots(report, images)
    parts = [tables.preamble(report), headline.summary(report), tables.machine(report)]
    for key, title, render in SECTIONS:
        section = _section(report, key, title, render, "##")
        if not section:
            continue
        if key in made:
            section += f"\n![{title}](img/{made[key]})\n"
        parts.append(section + tables.NOTES.get(key, ""))
    parts.append(tables.METHOD)
    docs.write_text("\n".join(parts).rstrip() + "\n", encoding="utf-8")


def plots(report: dict[str, Any], images: Path) -> dict[str, str]:
    """Draw what can be drawn; the file name per section. Nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return {}
    from bench import plots as drawing

    made: dict[str, str] = {}
    scenarios = report["scenarios"]
    if scenarios.get("latency", {}).get("status") == "ok":
        drawing.latency_cdf(
            scenarios["latency"]["result"], report["sides"], images / IMAGES["latency"]
        )
        made["latency"] = IMAGES["latency"]
    if any(scenarios.get(k, {}).get("status") == "ok" for k in ("drain", "writers", "enqueue")):
        drawing.throughput(scenarios, report["sides"], images / IMAGES["drain"])
        made["drain"] = IMAGES["drain"]
    return made
