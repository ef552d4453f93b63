"""The summary table at the top of docs/benchmarks.md: one line per headline figure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.tables import late, num, ratio, table

Row = dict[str, Any]
Line = tuple[str, Callable[[Any], Any], Callable[[Any], str], str]


def _more(text: str, how: str) -> str:
    return text if text == "n/a" else f"{text} {how}"


def _result(report: dict[str, Any], name: str) -> Any:
    entry = report["scenarios"].get(name)
    return entry["result"] if entry and entry["status"] == "ok" else None


def _row(rows: list[Row], **match: Any) -> Row | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _pair(rows: list[Row], field: str, **match: Any) -> tuple[Any, Any]:
    ours, peer = (_row(rows, side=k, **match) for k in ("ours", "peer"))
    return (ours or {}).get(field), (peer or {}).get(field)


def _latency(result: dict[str, Any], pct: str) -> list[tuple[str, Any, Any, str]]:
    lines = []
    for rate in result["rates"]:
        ours, peer = _pair(result["rows"], f"{pct}_ms", rate=rate)
        lines.append(
            (
                f"commit → broker {pct} at {rate:,} msg/s",
                late(ours),
                late(peer),
                _more(ratio(peer, ours), "lower"),
            )
        )
    return lines


def _drain(result: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    lines = []
    for relays in (1, 2):
        ours, peer = _pair(result["rows"], "per_s", relays=relays)
        lines.append(
            (
                f"drain, {relays} relay{'s' * (relays > 1)} (msg/s)",
                num(ours),
                num(peer),
                _more(ratio(ours, peer), "higher"),
            )
        )
    ours, peer = _pair(result["rows"], "relay_cpu_us_per_msg", relays=1)
    lines.append(
        (
            "relay CPU per message (1 relay)",
            f"{num(ours)} µs",
            f"{num(peer)} µs",
            _more(ratio(peer, ours), "lower"),
        )
    )
    return lines


def _idle(result: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    lines = []
    for field, what in (
        ("statements_per_min", "idle: SQL statements/min"),
        ("connections_per_min", "idle: new connections/min"),
    ):
        ours, peer = _pair(result["rows"], field)
        lines.append((what, num(ours), num(peer), ""))
    return lines


def _crash(result: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    def shown(row: Row | None) -> str:
        if row is None:
            return "n/a"
        return f"{row['seconds']:.2f} s" if row["recovered"] else f"> {row['cap_s']:.0f} s"

    ours, peer = _row(result["rows"], side="ours"), _row(result["rows"], side="peer")
    return [("relay killed: its claimed rows published after", shown(ours), shown(peer), "")]


def _enqueue(result: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    lines = []
    for per_tx in (1, 100):
        ours, peer = _pair(result["rows"], "rows_per_s", per_transaction=per_tx)
        lines.append(
            (f"enqueue, {per_tx} per transaction (rows/s)", num(ours), num(peer), ratio(ours, peer))
        )
    return lines


def _writers(result: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    most = max(result["writers"])
    ours = _row(result["rows"], config="ours", writers=most)
    peer = _row(result["rows"], config="peer", writers=most)
    shown = [f"{r['tps']:,.0f} tps" if r else "n/a" for r in (ours, peer)]
    return [
        (
            f"{most} writers, relay running",
            shown[0],
            shown[1],
            ratio(ours["tps"], peer["tps"]) if ours and peer else "",
        )
    ]


SOURCES: tuple[tuple[str, Callable[[Any], list[tuple[str, Any, Any, str]]]], ...] = (
    ("latency", lambda r: _latency(r, "p50") + _latency(r, "p99")),
    ("drain", _drain),
    ("writers", _writers),
    ("idle", _idle),
    ("crash", _crash),
    ("enqueue", _enqueue),
)


def summary(report: dict[str, Any]) -> str:
    """Ours next to the peer for each headline figure; empty without the peer."""
    if "peer" not in report["sides"]:
        return ""
    lines = []
    for name, make in SOURCES:
        result = _result(report, name)
        if result is not None:
            lines += [list(line) for line in make(result)]
    header = ["", report["sides"]["ours"], report["sides"]["peer"], "ours vs. peer"]
    return "## Summary\n\n" + table(header, lines)
