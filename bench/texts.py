"""The fixed text of docs/benchmarks.md: preamble, machine, broker lines, notes and method."""

from __future__ import annotations

from typing import Any

from bench.tables import BROKER_NAMES, table


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
    "versus": (
        "\nThe same benchmark, run against this checkout's relay and a previous commit's, "
        "alternating (previous first in odd rounds, this checkout first in even ones), so drift "
        "on the machine hits both: read the ratio, not the absolute figures. The previous "
        "commit's relay runs its own code from a virtualenv built from `git archive` "
        "(`.venv-versus/`, reused while the pinned releases stay the same) against a database "
        "its own migrations built. Alone: `make bench-versus` (`VERSUS=REV` for another "
        "commit or release tag), or `python -m bench.run --no-peer --brokers redis "
        "--scenarios versus --versus REV`; `make bench` runs it against the default commit.\n"
    ),
    "snapshot": (
        "\nThe verdicts are the acceptance of issue 23 for ours: p50 and p99 of the held phase "
        "within 2x of the same run's clean phase, relay CPU per message within 1.2x, and the "
        "table with its indexes back within 1.2x of its clean-phase size by the end of the "
        "recovery phase, without VACUUM FULL (autovacuum only; writer lag p99 shows whether "
        "writers waited). The figures share two cores with PostgreSQL, Redis, the producer, the "
        "consumer and whatever else runs on the machine (its load average is in the Machine "
        "section): compare phases within one run, not runs across machines.\n"
    ),
    "soak": (
        "\nA rising RSS line would be a leak in the relay; a table that keeps growing would be "
        "dead rows that autovacuum does not keep up with. Both share the machine with the rest "
        "of the benchmark, as above.\n"
    ),
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
        "process when it is private (`redis-server`; RabbitMQ's `beam.smp`, all its threads). "
        "Rows that name a `--batch-size` are our relays draining again at that batch size (on "
        "RabbitMQ, where each batch waits once for its publisher confirms with the next batch "
        "already written, so there the batch size sets the rate: docs/deploy.md, 'Batch "
        "size').\n"
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
        "column adds the transaction's BEGIN and COMMIT, spread over its calls, and with them "
        "the write of the transaction's rows.\n\n"
        "Where the time goes. A plain publish runs Celery's `send_task` (message building, "
        "routing, `argsrepr`) and then kombu's publish with one Redis round trip. Our "
        "`delay()` runs Celery's `Task.apply_async` (the same in both), then, for every call "
        "after the first of its task and options, fills the holes of the message Celery built "
        "for the first one (`templates._fill`: the id, `argsrepr`, origin, `reply_to`, custom "
        "header values; tests compare its rows with Celery's, byte for byte) and appends the "
        "validated row to the transaction's waiting rows: no round trip. The transaction "
        "writes its rows in one `INSERT` (one row) or one `COPY` (more) just before its next "
        "statement or its COMMIT (`deferred.commit` in the profile). With Sentry initialised "
        "both paths run Sentry's `apply_async`/`send_task` wrappers (a span and trace headers "
        "per call, most of the time in that case); the outbox applies Sentry's own wrapper "
        "around its template path, so Sentry's headers and spans are the same as through "
        "Celery. `bulk()` writes its rows in `COPY`s of 5,000, each full batch on a writer "
        "thread while the block builds the next (PostgreSQL spends about 16 µs a row storing "
        "a `COPY`: JSON checks, WAL, four indexes), so what limits it is Python: Celery's "
        "`Task.apply_async` (about a third of the instructions per task) and the fill (id, "
        "`AsyncResult`, JSON of the arguments, the options text, the `COPY` line). The relay "
        "drains rows "
        "written by `bulk()` like rows of single calls: both are the same text, written by "
        "`COPY` in id order. django-celery-outbox 0.4.3 imports sentry_sdk unconditionally, "
        "so it has no row where sentry-sdk is absent.\n"
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
