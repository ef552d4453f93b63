"""The summary table at the top of docs/benchmarks.md: one line per headline figure and broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.tables import BROKER_NAMES, late, num, ratio, table

Row = dict[str, Any]
Line = tuple[str, str, str, str]  # figure, ours, peer, comparison


def _versus(ours: Any, peer: Any) -> str:
    """How ours compares: 'Nx lower' or 'Nx higher' (never a ratio below 1)."""
    if not ours or not peer:
        return "n/a"
    if ours <= peer:
        return f"{ratio(peer, ours)} lower"
    return f"{ratio(ours, peer)} higher"


def _result(report: dict[str, Any], name: str) -> Any:
    entry = report["scenarios"].get(name)
    return entry["result"] if entry and entry["status"] == "ok" else None


def _row(rows: list[Row], **match: Any) -> Row | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _pair(rows: list[Row], field: str, **match: Any) -> tuple[Any, Any]:
    ours, peer = (_row(rows, side=k, **match) for k in ("ours", "peer"))
    return (ours or {}).get(field), (peer or {}).get(field)


def _latency(result: dict[str, Any]) -> list[Line]:
    lines = []
    for pct in ("p50", "p99"):
        for rate in result["rates"]:
            ours, peer = _pair(result["rows"], f"{pct}_ms", rate=rate)
            lines.append(
                (
                    f"commit → broker {pct} at {rate:,} msg/s",
                    late(ours),
                    late(peer),
                    _versus(ours, peer),
                )
            )
    return lines


def _drain(result: dict[str, Any]) -> list[Line]:
    lines = []
    for relays in (1, 2):
        ours, peer = _pair(result["rows"], "per_s", relays=relays, batch_size=None)
        lines.append(
            (
                f"drain, {relays} relay{'s' * (relays > 1)} (msg/s)",
                num(ours),
                num(peer),
                _versus(ours, peer),
            )
        )
    for row in result["rows"]:
        if row.get("batch_size") is not None:
            relays = row["relays"]
            lines.append(
                (
                    f"drain, {relays} relay{'s' * (relays > 1)}, ours at --batch-size "
                    f"{row['batch_size']:,} (msg/s)",
                    num(row["per_s"]),
                    "",
                    "",
                )
            )
    for field, what in (
        ("relay_cpu_us_per_msg", "relay CPU per message (1 relay)"),
        ("broker_cpu_us_per_msg", "broker CPU per message (1 relay)"),
    ):
        ours, peer = _pair(result["rows"], field, relays=1, batch_size=None)
        if ours is not None or peer is not None:
            lines.append((what, f"{num(ours)} µs", f"{num(peer)} µs", _versus(ours, peer)))
    return lines


def _crash(result: dict[str, Any]) -> list[Line]:
    def shown(row: Row | None) -> str:
        if row is None:
            return "n/a"
        return f"{row['seconds']:.2f} s" if row["recovered"] else f"> {row['cap_s']:.0f} s"

    ours, peer = _row(result["rows"], side="ours"), _row(result["rows"], side="peer")
    return [("relay killed: its claimed rows published after", shown(ours), shown(peer), "")]


def _writers(result: dict[str, Any], broker: str) -> list[Line]:
    most = max(result["writers"])
    suffix = "" if broker == "redis" else f"-{broker}"
    ours = _row(result["rows"], config=f"ours{suffix}", writers=most)
    peer = _row(result["rows"], config=f"peer{suffix}", writers=most)
    if ours is None and peer is None:
        return []
    shown = [f"{r['tps']:,.0f} tps" if r else "n/a" for r in (ours, peer)]
    compared = _versus(ours["tps"], peer["tps"]) if ours and peer else ""
    return [(f"{most} writers, relay running", shown[0], shown[1], compared)]


def _idle(result: dict[str, Any]) -> list[Line]:
    lines = []
    for field, what in (
        ("statements_per_min", "idle: SQL statements/min"),
        ("connections_per_min", "idle: new connections/min"),
    ):
        ours, peer = _pair(result["rows"], field)
        lines.append((what, num(ours), num(peer), ""))
    return lines


def _enqueue(result: dict[str, Any]) -> list[Line]:
    lines = []
    for per_tx in (1, 100):
        ours, peer = _pair(result["rows"], "rows_per_s", per_transaction=per_tx)
        lines.append(
            (
                f"enqueue, {per_tx} per transaction (rows/s)",
                num(ours),
                num(peer),
                _versus(ours, peer),
            )
        )
    return lines


PER_BROKER: tuple[tuple[str, Callable[[Any], list[Line]]], ...] = (
    ("latency", _latency),
    ("drain", _drain),
    ("crash", _crash),
)
NO_BROKER: tuple[tuple[str, Callable[[Any], list[Line]]], ...] = (
    ("idle", _idle),
    ("enqueue", _enqueue),
)
NONE = "none (no publishing)"


def _lines(report: dict[str, Any]) -> list[list[str]]:
    """(figure, broker, ours, peer, comparison) for every headline figure the report has."""
    lines: list[list[str]] = []
    for broker in report["brokers"]:
        name = BROKER_NAMES.get(broker, broker)
        for key, make in PER_BROKER:
            result = _result(report, f"{key}.{broker}")
            if result is not None:
                lines += [[figure, name, *rest] for figure, *rest in make(result)]
        writers = _result(report, "writers")
        if writers is not None:
            lines += [[figure, name, *rest] for figure, *rest in _writers(writers, broker)]
    for key, make in NO_BROKER:
        result = _result(report, key)
        if result is not None:
            lines += [[figure, NONE, *rest] for figure, *rest in make(result)]
    return lines


def summary(report: dict[str, Any]) -> str:
    """Ours next to the peer for each headline figure, broker by broker; empty without the peer."""
    if "peer" not in report["sides"]:
        return ""
    header = ["", "broker", report["sides"]["ours"], report["sides"]["peer"], "ours vs. peer"]
    return "## Summary\n\n" + table(header, _lines(report))
