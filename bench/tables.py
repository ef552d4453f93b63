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
            r = _by(result["rows"], side=key, relays=relays)
            if r is not None:
                rows.append(_drain_row(r, relays, label))
        ours = _by(result["rows"], side="ours", relays=relays)
        peer = _by(result["rows"], side="peer", relays=relays)
        if ours and peer:
            rows.append(_drain_ratio(ours, peer, relays))
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


# --- fixed text -------------------------------------------------------------------------


def preamble(report: dict[str, Any]) -> str:
    peer = "peer" in report["sides"]
    title = (
        "outbox-notify and django-celery-outbox 0.4.3, side by side" if peer else "outbox-notify"
    )
    names = " and ".join(report["brokers"].values())
    return (
        f"# Benchmarks: {title}\n\n"
        f"Measured with `make bench` (`{report['command']}`) on {report['started_at']}, "
        f"{report['mode']} mode, in {report['runtime_s']:.0f} s, with {names} as the broker "
        "(every figure below says which). Raw figures: `bench/results/latest.json`. Re-run on "
        "your own machine before relying on a figure: every number below depends on the disk's "
        "fsync time and the CPU.\n"
    )


BROKER_SETUP = {
    "redis": (
        "each library publishes to its own list (Celery's default routing); the benchmark reads "
        "the list's length and BRPOPs it"
    ),
    "rabbitmq": (
        "each library publishes to its own durable queue, declared as Celery declares its "
        "default queue (a direct exchange of the same name), persistent messages (Celery's "
        "default delivery mode); outbox-notify's relay waits for publisher confirms (it always "
        "does on AMQP), django-celery-outbox publishes at Celery's defaults (no confirms); the "
        "benchmark reads the queue's ready messages and consumes it with basic.consume"
    ),
}


def broker_line(report: dict[str, Any], broker: str) -> str:
    """One line under a per-broker heading: which server, and how its queues are set up."""
    found = report["machine"].get("brokers", {}).get(broker, {})
    server = f"{found.get('version', '?')}, {found.get('server', '?')}" if found else "?"
    return (
        f"Broker: {BROKER_NAMES.get(broker, broker)} {server}; {BROKER_SETUP.get(broker, '')}.\n\n"
    )


def machine(report: dict[str, Any]) -> str:
    m = report["machine"]
    pg = m["postgresql"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    modified = (
        " (relay code modified in the working tree)" if m["checkout"]["relay_modified"] else ""
    )
    brokers = [
        [BROKER_NAMES.get(key, key), f"{b['version']}, {b['server']}"]
        for key, b in m.get("brokers", {}).items()
    ]
    rows = [
        ["CPU", f"{m['nproc']} x {m['cpu']}"],
        ["memory", m["memory"]],
        ["OS", m["platform"]],
        [
            "PostgreSQL",
            f"{pg['server_version']}, {pg['server']}; fsync={pg['fsync']}, "
            f"synchronous_commit={pg['synchronous_commit']}, full_page_writes={pg['full_page_writes']}, "
            f"wal_sync_method={pg['wal_sync_method']}, shared_buffers={pg['shared_buffers']}",
        ],
        *brokers,
        ["Python", m["python"]],
        ["packages", packages],
        ["checkout", f"{m['checkout']['commit']}{modified}"],
        ["load average at the start", " / ".join(f"{x:.2f}" for x in m["load_average"])],
    ]
    return "## Machine\n\n" + table(["", ""], rows)


NOTES = {
    "latency": (
        "\nA producer commits one row per transaction at a fixed rate (8 connections, so the rate "
        "does not hang on one connection's fsync) and stamps each commit's return; a separate "
        "consumer process takes each message off the broker as it arrives (Redis: BRPOP; "
        "RabbitMQ: basic.consume without acks) and stamps it (both CLOCK_MONOTONIC). The rows "
        "are copies of a row the library's own `delay()` wrote, each with a fresh task id. Where "
        "a relay publishes slower than the rate, its backlog and its latency grow through the "
        "run; what it has not published a few seconds after the producer stops counts as not "
        "delivered.\n"
    ),
    "drain": (
        "\nThe relays start on an empty table; the backlog is inserted in one transaction and the "
        "clock runs from the commit's return until the broker's queue holds every message (the "
        "Redis list's length; the RabbitMQ queue's ready messages), or the cap. CPU is utime + "
        "stime from /proc: of the relay processes, of the whole PostgreSQL process tree "
        "(backends that exited included) when the server is private, and of the broker's server "
        "process when it is private (`redis-server`; RabbitMQ's `beam.smp`, all its threads).\n"
    ),
    "writers": (
        "\npgbench clients each commit one outbox row per transaction (the same realistic row as "
        "above). The relays that run beside the writers publish what they can and compete for the "
        "same two cores, with the broker they publish to (named in each row), so part of a "
        "'relay running' ratio is CPU taken by the relay and the broker, not the trigger; the "
        "'no relay' rows involve no broker and isolate the trigger. A relay that publishes more "
        "during the run (the count in its cells) also puts more CPU and WAL on the same machine; "
        "run-to-run noise here is large (±20 %), so read the ratios as 'about the same', not as "
        "rankings. NOTIFYs are counted with pg_stat_statements (track=all sees the trigger's "
        "pg_notify).\n"
    ),
    "idle": (
        "\nOne relay per library at its defaults, both at once on empty tables, each in its own "
        "database, connected to the run's first broker but with nothing to publish: these "
        "figures are the database's and the relay's, not a broker's. Statements from "
        "pg_stat_statements, new connections from pg_stat_database.sessions, CPU from /proc. "
        "django-celery-outbox polls every second and, with Django's default CONN_MAX_AGE=0, "
        "reconnects for each poll.\n"
    ),
    "crash": (
        "\nTwo relays drain a committed backlog (its size is in the table); early in it both are "
        "frozen (SIGSTOP), the rows they hold are read, one gets SIGKILL and the other continues. "
        "Ours holds rows by row locks in an open transaction, which PostgreSQL releases when the "
        "connection drops; django-celery-outbox marks rows in flight and leaves them until its "
        "300 s stale timeout. Both relays' held rows are counted; the survivor's are published "
        "within its batch. Duplicates are messages in the broker's queue beyond the backlog: "
        "rows the killed relay had published but not yet deleted.\n"
    ),
    "enqueue": (
        "\n`task.delay()` inside `transaction.atomic()` on the library's database, in one process, "
        "no relay running and no broker involved (both libraries only write a row). With one "
        "message per transaction the figure is bound by the commit's fsync.\n"
    ),
    "delay": (
        "\nOne process per Sentry case (`python -m bench.enqueue measure --sentry CASE`), "
        "rounds rotating the order, best round shown. A `delay()` is timed alone; the last "
        "column adds the transaction's BEGIN and COMMIT (one fsync), spread over its calls. "
        "Where the time goes: Celery's own `send_task` (message, routing, `argsrepr`) is "
        "common to all paths; a plain publish then makes one Redis round trip, we make one "
        "PostgreSQL round trip whose server side (parse, plan, the statement trigger, WAL, two "
        "indexes) costs more than an LPUSH. The profile shows the split. `bulk()` pays the "
        "round trip once per 5,000 rows and skips most of `send_task` for repeated shapes; "
        "with Sentry initialised its Celery integration adds trace headers to every call, "
        "which sends each call through Celery's full path.\n"
    ),
    "ceiling": (
        "\nNo database: how fast Celery messages reach the broker at all from one Python process. "
        "`KombuPublisher` is the relay's general path; the relay itself uses the publisher "
        "`outbox_notify.relay.runner` builds (listed when it is another class). Its drain rate "
        "above can approach that figure but not exceed it. Plain `send_task` is also what "
        "django-celery-outbox's relay calls per message (on RabbitMQ at Celery's defaults: no "
        "publisher confirms, while our publishers wait for them); with kombu 5.7 and redis-py 8, "
        "about a fifth of each such call on Redis goes to building a new redis client.\n"
    ),
}

METHOD = """\
## Method

- Both relays run at their defaults: ours `manage.py outbox_listen` (batch 100, sweep every
  2 s), django-celery-outbox `manage.py celery_outbox_relay` (batch 100, idle 1 s, stale
  timeout 300 s; its StatsD metrics are on by default and go to localhost:9125, where nothing
  listens). Neither project configures logging, so both print their default structlog lines.
- The benchmark project (`bench/project/`) installs both apps; a database router keeps each
  library's tables in its own database, so neither relay ever sees the other's rows. Each
  library publishes to its own queue.
- Brokers: a private `redis-server` without persistence, and a private RabbitMQ node
  (`devtools.rabbitserver`: its own node name, ports, data and log directories, never the
  machine's shared RabbitMQ) whose queues are durable and whose messages are persistent, as
  Celery declares and sends them. Scenarios that touch a broker run on each in turn.
- Scenarios alternate the libraries (ours, peer, ours, peer ...), so drift on the machine hits
  both alike. The machine is small and may be shared: compare within a table, not across runs.
"""
