"""Markdown tables of each scenario's results, and the fixed text around them."""

from __future__ import annotations

from typing import Any

Sides = dict[str, str]


def ms(value: float | None) -> str:
    """A latency in ms or s, with sensible digits."""
    if value is None:
        return "n/a"
    if value >= 1000:
        return f"{value / 1000:.2f} s"
    return f"{value:.1f} ms" if value >= 10 else f"{value:.2f} ms"


def late(value: float | None) -> str:
    """A latency percentile; None means it fell on a message that was never delivered."""
    return "not delivered" if value is None else ms(value)


def num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    """a / b as '12.3x'; n/a when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return "n/a"
    value = a / b
    if value >= 100:
        return f"{value:,.0f}x"
    return f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _by(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


# --- scenarios --------------------------------------------------------------------------


def latency(result: dict[str, Any], sides: Sides) -> str:
    out = []
    for rate in result["rates"]:
        rows = []
        for key, label in sides.items():
            r = _by(result["rows"], side=key, rate=rate) or {}
            rows.append(
                [
                    label,
                    num(r.get("achieved_rate")),
                    f"{r.get('messages', 0):,}",
                    str(r.get("missing", "?")),
                    late(r.get("p50_ms")),
                    late(r.get("p90_ms")),
                    late(r.get("p99_ms")),
                    late(r.get("max_ms")),
                ]
            )
        ours, peer = (_by(result["rows"], side=k, rate=rate) or {} for k in ("ours", "peer"))
        if "peer" in sides:
            rows.append(
                [
                    "**peer ÷ ours**",
                    "",
                    "",
                    "",
                    *(
                        ratio(peer.get(f"{p}_ms"), ours.get(f"{p}_ms"))
                        for p in ("p50", "p90", "p99", "max")
                    ),
                ]
            )
        out.append(
            f"**{rate:,} messages/s** ({result['rounds']} round(s) of {result['seconds']:g} s each)\n\n"
            + table(
                ["library", "achieved msg/s", "messages", "missing", "p50", "p90", "p99", "max"],
                rows,
            )
        )
    return "\n".join(out)


def _drain_row(r: dict[str, Any], relays: int, label: str) -> list[str]:
    capped = "" if r.get("complete", True) else f" (cap; {r['published']:,} published)"
    return [
        str(relays),
        label,
        num(r["per_s"]),
        f"{r['seconds']:.1f} s{capped}",
        num(r["relay_cpu_us_per_msg"]),
        num(r["pg_cpu_us_per_msg"]),
        num(r.get("broker_cpu_us_per_msg")),
        f"{r['first_after_s'] * 1000:.0f} ms",
        str(r["duplicates"]),
    ]


def _drain_ratio(ours: dict[str, Any], peer: dict[str, Any], relays: int) -> list[str]:
    return [
        str(relays),
        "**ours ÷ peer** (CPU: peer ÷ ours)",
        ratio(ours["per_s"], peer["per_s"]),
        "",
        ratio(peer["relay_cpu_us_per_msg"], ours["relay_cpu_us_per_msg"]),
        ratio(peer["pg_cpu_us_per_msg"], ours["pg_cpu_us_per_msg"]),
        ratio(peer.get("broker_cpu_us_per_msg"), ours.get("broker_cpu_us_per_msg")),
        "",
        "",
    ]


def drain(result: dict[str, Any], sides: Sides) -> str:
    rows = []
    for relays in (1, 2):
        for key, label in sides.items():
            r = _by(result["rows"], side=key, relays=relays, batch_size=None)
            if r is not None:
                rows.append(_drain_row(r, relays, label))
        ours = _by(result["rows"], side="ours", relays=relays, batch_size=None)
        peer = _by(result["rows"], side="peer", relays=relays, batch_size=None)
        if ours and peer:
            rows.append(_drain_ratio(ours, peer, relays))
    for r in result["rows"]:
        if r.get("batch_size") is not None:
            label = f"{sides.get(r['side'], r['side'])}, `--batch-size {r['batch_size']:,}`"
            rows.append(_drain_row(r, r["relays"], label))
    header = [
        "relays",
        "library",
        "messages/s",
        "time",
        "relay CPU µs/msg",
        "PostgreSQL CPU µs/msg",
        "broker CPU µs/msg",
        "first message after",
        "duplicates",
    ]
    notes = ""
    if not result["postgres_cpu"]:
        notes += "\nPostgreSQL CPU: n/a (not a server the benchmark started).\n"
    if not result.get("broker_cpu"):
        notes += "\nBroker CPU: n/a (not a server the benchmark started).\n"
    cap = f", at most {result['cap_s']:.0f} s each" if "cap_s" in result else ""
    return (
        f"Backlog: {result['backlog']:,} committed messages{cap}.\n\n" + table(header, rows) + notes
    )


def writers(result: dict[str, Any], sides: Sides) -> str:
    rows = []
    for label in dict.fromkeys(writer_label(r) for r in result["rows"]):
        cells = []
        for count in result["writers"]:
            r = next(
                (x for x in result["rows"] if writer_label(x) == label and x["writers"] == count),
                None,
            )
            if r is None:
                cells.append("")
                continue
            share = r.get("notified_share")
            notified = "" if share is None or r["config"] == "peer" else f", {share:.0%} notified"
            base = r.get("ratio_to_no_trigger")
            published = r.get("published_during_run")
            notified += "" if published is None else f"; relay published {published:,}"
            cells.append(f"{r['tps']:,.0f} ({'n/a' if base is None else f'{base:.2f}'}{notified})")
        rows.append([label, *cells])
    header = ["configuration", *(f"{w} writer{'s' * (w > 1)}" for w in result["writers"])]
    return (
        f"Transactions/s ({result['seconds']} s per run), ratio to our table without the trigger, "
        "share of transactions that sent a NOTIFY, messages the relay published meanwhile.\n\n"
        + table(header, rows)
    )


def writer_label(row: dict[str, Any]) -> str:
    """The configuration's label, naming the broker its relay publishes to."""
    label = str(row["label"])
    broker = row.get("broker")
    if broker and "(" not in label:
        label += f" ({BROKER_NAMES.get(broker, broker)})"
    return label


BROKER_NAMES = {"redis": "Redis", "rabbitmq": "RabbitMQ"}


def idle(result: dict[str, Any], sides: Sides) -> str:
    rows = [
        [
            sides[r["side"]],
            num(r["statements_per_min"]),
            num(r["connections_per_min"]),
            num(r["transactions_per_min"]),
            f"{r['relay_cpu_s']:.2f} s",
        ]
        for r in result["rows"]
    ]
    header = [
        "library",
        "SQL statements/min",
        "new connections/min",
        "transactions/min",
        f"relay CPU over {result['window_s']:.0f} s",
    ]
    note = (
        ""
        if result["pg_stat_statements"]
        else "\nStatements: n/a (pg_stat_statements is not loaded on that server).\n"
    )
    return table(header, rows) + note + _idle_statements(result, sides)


def _idle_statements(result: dict[str, Any], sides: Sides) -> str:
    """What each idle relay runs most often."""
    out = []
    for r in result["rows"]:
        top = r.get("top_statements_per_min") or []
        if top:
            rows = [[f"`{t['statement'].replace('|', '/')}`", num(t["per_min"], 1)] for t in top]
            out.append(
                f"\n{sides[r['side']]}, most frequent statements while idle:\n\n"
                + table(["statement", "per min"], rows)
            )
    return "".join(out)


def crash(result: dict[str, Any], sides: Sides) -> str:
    rows = []
    for r in result["rows"]:
        seconds = f"{r['seconds']:.2f} s" if r["recovered"] else f"> {r['cap_s']:.0f} s (cap)"
        rows.append(
            [
                sides[r["side"]],
                f"{r['backlog']:,}",
                f"{r['held_at_kill']:,}",
                seconds,
                f"{r['unpublished_at_cap']:,}",
                str(r["duplicates"]),
            ]
        )
    header = [
        "library",
        "backlog",
        "rows held at the kill",
        "kill → all of them published",
        "still unpublished at the end",
        "duplicates",
    ]
    return table(header, rows)


def enqueue(result: dict[str, Any], sides: Sides) -> str:
    rows = []
    for per_tx in sorted({r["per_transaction"] for r in result["rows"]}):
        cells = [
            num((_by(result["rows"], side=k, per_transaction=per_tx) or {}).get("rows_per_s"))
            for k in sides
        ]
        ours = _by(result["rows"], side="ours", per_transaction=per_tx)
        peer = _by(result["rows"], side="peer", per_transaction=per_tx)
        extra = [ratio(ours["rows_per_s"], peer["rows_per_s"])] if ours and peer else []
        rows.append([str(per_tx), *cells, *extra])
    header = ["messages per transaction", *(f"{label} rows/s" for label in sides.values())]
    if "peer" in sides:
        header.append("ours ÷ peer")
    return table(header, rows)


def ceiling(result: dict[str, Any], sides: Sides) -> str:
    plain = result["plain_send_task"]
    rows = [
        [
            "plain `celery.Celery.send_task` at Celery's defaults, one call per message",
            num(plain["per_s"]),
            num(plain["us_per_message"]),
        ]
    ]
    for name, path in result["ours"].items():
        for key, what in (
            (
                "prepare_and_publish",
                f"our path: `messages.prepare` + `{name}.publish`, batches of 100",
            ),
            ("prepare_only", "… of which `messages.prepare`"),
            ("publish_only", f"… of which `{name}.publish`"),
        ):
            rows.append([what, num(path[key]["per_s"]), num(path[key]["us_per_message"])])
    return table(["path", "messages/s", "µs/message"], rows)


def profile(result: dict[str, Any], sides: Sides) -> str:
    timing = result["drain_under_profiler"]
    head = (
        f"{result['samples']:,} py-spy samples taken while one relay drained (waits on the "
        f"database and the broker included) {timing['backlog']:,} messages at "
        f"{timing['per_s']:,.0f}/s under the profiler. Shares are of those samples.\n\n"
    )
    pairs = zip(result["self"], result["total"], strict=False)
    rows = [
        [own["name"], f"{own['percent']}%", tot["name"], f"{tot['percent']}%"] for own, tot in pairs
    ]
    packages = [[p["name"], f"{p['percent']}%"] for p in result["packages"] if p["percent"] >= 0.5]
    return (
        head
        + table(["leaf function (self)", "share", "function on the stack (total)", "share"], rows)
        + "\nBy package of the leaf function:\n\n"
        + table(["package", "share"], packages)
    )
