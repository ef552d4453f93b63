"""What relays cost while a writer keeps the wake lock for 10 s, counted statement by statement.

    python -m bench.long_writer [--runs N] [--compare OTHER_CHECKOUT] [--json PATH]

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
import statistics
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


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs: statements per second per relay connection kind, and the latency."""
    # Kinds the test sampled but that ran no statement in the window count as 0.
    kinds = sorted(
        {kind for run in runs for kind in (*run["statements_per_s"], *run["sampled_per_s"])}
    )
    return {
        "runs": len(runs),
        "tests_passed": sum(1 for run in runs if run["test_passed"]),
        "window_s": statistics.median(run["window_s"] for run in runs),
        "statements_per_s": {
            kind: statistics.median(run["statements_per_s"].get(kind, 0.0) for run in runs)
            for kind in kinds
        },
        "commit_to_publish_ms": statistics.median(run["commit_to_publish_ms"] for run in runs),
    }


def markdown(figures: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a run's figures (this checkout's runs only)."""
    median = figures["summary"]
    rows = [f"| `{kind}` | {rate:g} |" for kind, rate in median["statements_per_s"].items()] or [
        "| (none) | 0 |"
    ]
    return (
        "Two relays (`--batch-size 1`) woken by a 300-row burst while a writer inserts and "
        "holds the wake lock for 10 s before it commits (`tests/integration/test_wake_lock.py`, `python -m "
        "bench.long_writer`): statements per second each relay connection kind ran inside "
        f"the window, from PostgreSQL's statement log; medians of {median['runs']} runs "
        f"({median['tests_passed']} of them with the test passing), window "
        f"{median['window_s']:.1f} s.\n\n"
        "| relay connection | statements/s |\n|---|---|\n"
        + "\n".join(rows)
        + f"\n\nCommit of the long writer to its message in Redis: "
        f"{median['commit_to_publish_ms']:.1f} ms (median).\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.long_writer", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--compare",
        type=Path,
        help="another checkout (with this test) to run alternately with this one, e.g. main",
    )
    parser.add_argument("--json", type=Path, help="also write this checkout's figures here")
    args = parser.parse_args(argv)
    roots = [ROOT] if args.compare is None else [args.compare.resolve(), ROOT]
    mine: list[dict[str, Any]] = []
    with pgserver.running(pgserver.FAST_OPTIONS + LOG_OPTIONS) as server:
        for run in range(args.runs):
            for root in roots:
                result = run_once(server, root)
                print(f"run {run + 1} {root}: {json.dumps(result)}", flush=True)
                if root == ROOT:
                    mine.append(result)
    if args.json:
        figures = {"summary": summary(mine), "runs": mine}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
