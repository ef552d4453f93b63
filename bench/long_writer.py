"""What relays cost while a writer keeps the wake lock for 10 s, counted statement by statement.

    python -m bench.long_writer [--runs N] [--compare OTHER_CHECKOUT]

Runs tests/integration/test_wake_lock.py's long-writer test (two relays woken by a burst, a
writer that inserts while they drain and commits 10 s later) against a private PostgreSQL
that logs every statement, then counts the statements each relay connection ran between the
test's window markers, and prints them per second with the test's commit->publish latency.
pg_stat_statements would miss the wake-lock waits that end in a lock timeout (it counts only
statements that complete); the statement log has them all.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools import pgserver

ROOT = Path(__file__).resolve().parent.parent
TEST = (
    "tests/integration/test_wake_lock.py::test_a_long_writer_transaction_does_not_make_relays_spin"
)
LOG_OPTIONS = " -c log_statement=all -c log_line_prefix='%p|%a|'"
START, END = "outbox-notify-window-start", "outbox-notify-window-end"
# One logged statement: "pid|application_name|LOG:  execute <unnamed>: ..." or "... statement: ..."
STATEMENT = re.compile(r"^(\d+)\|([^|]*)\|LOG:\s+(?:execute [^:]*|statement): ")
RESULT = re.compile(
    r"long writer: window ([\d.]+) s, statements/s (\{.*\}), commit->publish ([\d.]+) ms"
)


def count_statements(log: str) -> dict[str, int]:
    """Statements per relay connection kind between the test's window markers."""
    counts: collections.Counter[str] = collections.Counter()
    inside = False
    for line in log.splitlines():
        if START in line:
            inside = True
            continue
        if END in line:
            break
        match = STATEMENT.match(line)
        if inside and match and match.group(2).startswith("outbox_notify."):
            counts[match.group(2)] += 1
    return dict(counts)


def run_once(server: pgserver.PrivateServer, root: Path) -> dict[str, Any]:
    """One run of `root`'s test against `server`; the figures it printed and the log's counts."""
    log_path = server.base / "server.log"
    offset = log_path.stat().st_size
    env = {**os.environ, "OUTBOX_TEST_DATABASE_URL": server.url()}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TEST, "-s", "-q"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    printed = RESULT.search(done.stdout)
    if printed is None:
        raise SystemExit(f"the test printed no figures (exit {done.returncode}):\n{done.stdout}")
    with log_path.open(errors="replace") as log:
        log.seek(offset)
        counts = count_statements(log.read())
    window = float(printed.group(1))
    return {
        "test_passed": done.returncode == 0,
        "window_s": window,
        "statements_per_s": {name: round(n / window, 1) for name, n in sorted(counts.items())},
        "sampled_per_s": json.loads(printed.group(2).replace("'", '"')),
        "commit_to_publish_ms": float(printed.group(3)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.long_writer", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--compare",
        type=Path,
        help="another checkout (with this test) to run alternately with this one, e.g. main",
    )
    args = parser.parse_args(argv)
    roots = [ROOT] if args.compare is None else [args.compare.resolve(), ROOT]
    with pgserver.running(pgserver.FAST_OPTIONS + LOG_OPTIONS) as server:
        for run in range(args.runs):
            for root in roots:
                result = run_once(server, root)
                print(f"run {run + 1} {root}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
