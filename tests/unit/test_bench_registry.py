"""The benchmarks registered in bench.standalone run under `make bench` and render in the docs."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report, run, standalone

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bench", standalone.REGISTRY, ids=standalone.KEYS)
def test_a_registered_benchmark_takes_json_and_its_quick_arguments(
    bench: standalone.Standalone,
) -> None:
    """Its module parses the arguments bench.run passes it and defines markdown()."""
    module = importlib.import_module(bench.module)
    assert callable(module.markdown)
    done = subprocess.run(
        [sys.executable, "-m", bench.module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for argument in ("--json", *(bench.quick or ()), *bench.full):
        assert argument in done.stdout, (bench.module, argument)


def test_quick_mode_leaves_out_benchmarks_without_a_quick_mode() -> None:
    """`make bench` runs every registered benchmark; `make bench-quick` only those with --quick."""
    full = run.parse_args([])
    quick = run.parse_args(["--quick"])
    assert set(standalone.KEYS) <= set(full.scenarios)
    assert [k for k in quick.scenarios if k in standalone.KEYS] == [
        b.key for b in standalone.REGISTRY if b.quick is not None
    ]
    assert "long_writer" not in quick.scenarios


def test_each_registered_benchmark_has_its_section(tmp_path: Path) -> None:
    """Its figures become a `## title` section of docs/benchmarks.md, rendered by its module."""
    figures = {
        "summary": {
            "runs": 1,
            "tests_passed": 1,
            "window_s": 10.0,
            "statements_per_s": {"outbox_notify.listen": 0.5, "outbox_notify.claim": 0.0},
            "commit_to_publish_ms": 12.5,
        },
        "runs": [],
    }
    entry = {"status": "ok", "seconds": 1.0, "result": figures}
    failed = {"status": "error", "seconds": 1.0, "error": "Traceback\nBenchError: held broke"}
    saved = {
        "command": "python -m bench.run",
        "mode": "full",
        "started_at": "now",
        "runtime_s": 1.0,
        "sides": {"ours": "outbox-notify"},
        "brokers": {"redis": "Redis"},
        "scenarios": {"long_writer": entry, "held": failed},
    }
    text = report.text(json.loads(json.dumps(saved)))
    title = standalone.entry("long_writer").title
    assert f"## {title}\n" in text
    assert "| `outbox_notify.claim` | 0 |" in text
    assert "12.5 ms" in text
    assert f"## {standalone.entry('held').title}\n\nFailed: `BenchError: held broke`" in text
