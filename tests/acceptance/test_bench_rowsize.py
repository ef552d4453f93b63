"""`python -m bench.rowsize` runs end to end and prints row and WAL bytes for every case.

Only that it ran and printed a figure per case is checked: the bound on a row's size is
tests/integration/test_compact_rows.py's, and figures belong in the benchmark's output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # seconds: generous; a quick run takes well under a minute


def test_a_quick_run_prints_bytes_per_message_for_each_case(tmp_path: Path) -> None:
    """Each case gets a table line with its row bytes and WAL bytes, and the JSON has them."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = tmp_path / "rowsize.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.rowsize", "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    for case, fig in figures["cases"].items():
        line = re.search(rf"^\| {re.escape(case)} \| ([\d,]+) \|", done.stdout, re.M)
        assert line is not None, done.stdout
        assert fig["row_bytes"] > 0
        assert set(fig["wal_bytes_per_message"]) == {"1", "100"}
