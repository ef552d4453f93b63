"""Turns a results report into Markdown tables, PNG plots and docs/benchmarks.md.

Scenarios that depend on the broker are stored once per broker (`latency.redis`,
`latency.rabbitmq`, ...) and rendered as one section with a subsection per broker, each
saying which broker it measured.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import enqueue, headline, snapshot, soak, standalone, tables, texts, versus

Render = Callable[[dict[str, Any], dict[str, str]], str]
SECTIONS: tuple[tuple[str, str, Render], ...] = (
    ("latency", "Latency: commit to broker", tables.latency),
    ("drain", "Drain throughput", tables.drain),
    ("writers", "Writer concurrency", tables.writers),
    ("idle", "Idle cost", tables.idle),
    ("crash", "Crash recovery", tables.crash),
    ("enqueue", "Enqueue cost", tables.enqueue),
    ("delay", "One delay(): ours, the peer and a plain Celery publish", enqueue.table),
    ("ceiling", "Ceiling: publishing to the broker without a database", tables.ceiling),
    ("profile", "Where our relay's time goes (py-spy, drain of one relay)", tables.profile),
    ("versus", "Against a previous commit: Redis drain and latency, alternating", versus.markdown),
    ("snapshot", "An old snapshot held open under sustained load", snapshot.markdown),
    ("soak", "Soak: a steady rate for 30 minutes", soak.markdown),
    *((bench.key, bench.title, standalone.renderer(bench)) for bench in standalone.REGISTRY),
)
PER_BROKER = ("crash", "latency", "drain", "ceiling", "profile")
LATENCY_IMAGE = {"redis": "latency_cdf.png"}  # other brokers: latency_cdf_<broker>.png
THROUGHPUT_IMAGE = "throughput.png"
SUSTAINED_IMAGES = {"snapshot": ("snapshot.png", snapshot.plot), "soak": ("soak.png", soak.plot)}


def upgrade(report: dict[str, Any]) -> dict[str, Any]:
    """A report saved before RabbitMQ was benchmarked, in today's shape (all of it Redis)."""
    if "brokers" in report:
        return report
    report["brokers"] = {"redis": "Redis"}
    scenarios = report["scenarios"]
    for name in PER_BROKER:
        if name in scenarios:
            scenarios[f"{name}.redis"] = scenarios.pop(name)
    machine = report.get("machine", {})
    if "redis" in machine:
        old = machine.pop("redis")
        machine["brokers"] = {"redis": {**old, "broker_cpu": False}}
    for row in scenarios.get("writers", {}).get("result", {}).get("rows", []):
        row.setdefault("broker", "redis" if row["config"] in ("ours", "peer") else None)
    return report


def _body(entry: dict[str, Any], render: Render, sides: dict[str, str]) -> str:
    if entry["status"] != "ok":
        last = entry["error"].strip().splitlines()[-1]
        return f"Failed: `{last}`\n"
    return render(entry["result"], sides) + "\n"


def _section(report: dict[str, Any], key: str, title: str, render: Render) -> str:
    """`## title` and the scenario's tables (one subsection per broker where it has them)."""
    scenarios = report["scenarios"]
    if key not in PER_BROKER:
        entry = scenarios.get(key)
        return "" if entry is None else f"## {title}\n\n" + _body(entry, render, report["sides"])
    parts = []
    for broker, label in report["brokers"].items():
        entry = scenarios.get(f"{key}.{broker}")
        if entry is not None:
            head = f"### {label}\n\n" + texts.broker_line(report, broker)
            parts.append(head + _body(entry, render, report["sides"]))
    return f"## {title}\n\n" + "\n".join(parts) if parts else ""


def text(report: dict[str, Any]) -> str:
    """Every table, for the terminal."""
    report = upgrade(report)
    parts = [_section(report, key, title, render) for key, title, render in SECTIONS]
    return "\n".join(p for p in parts if p)


def write_docs(report: dict[str, Any], docs: Path, images: Path) -> None:
    """docs/benchmarks.md and its plots."""
    report = upgrade(report)
    images.mkdir(parents=True, exist_ok=True)
    made = plots(report, images)
    parts = [texts.preamble(report), headline.summary(report), texts.machine(report)]
    for key, title, render in SECTIONS:
        section = _section(report, key, title, render)
        if not section:
            continue
        for file in made.get(key, []):
            section += f"\n![{title}](img/{file})\n"
        parts.append(section + texts.NOTES.get(key, ""))
    parts.append(texts.METHOD)
    docs.write_text("\n".join(parts).rstrip() + "\n", encoding="utf-8")


def _ok(report: dict[str, Any], key: str) -> Any:
    entry = report["scenarios"].get(key)
    return entry["result"] if entry and entry["status"] == "ok" else None


def plots(report: dict[str, Any], images: Path) -> dict[str, list[str]]:
    """Draw what can be drawn; the file names per section. Nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return {}
    from bench import plots as drawing

    made: dict[str, list[str]] = {}
    for broker, label in report["brokers"].items():
        result = _ok(report, f"latency.{broker}")
        if result is not None:
            name = LATENCY_IMAGE.get(broker, f"latency_cdf_{broker}.png")
            drawing.latency_cdf(result, report["sides"], images / name, label)
            made.setdefault("latency", []).append(name)
    if drawing.throughput(report, images / THROUGHPUT_IMAGE):
        made["drain"] = [THROUGHPUT_IMAGE]
    for key, (name, draw) in SUSTAINED_IMAGES.items():
        result = _ok(report, key)
        if result is not None and draw(result, images / name):
            made[key] = [name]
    return made
