"""bench.versus: medians per side, the ratio this checkout / previous, every run in the report."""

from __future__ import annotations

from typing import Any

import pytest

from bench import run, versus


def _run(rnd: int, side: str, per_s: float, p50: float | None) -> dict[str, Any]:
    return {
        "round": rnd,
        "side": side,
        "drain_per_s": per_s,
        "relay_cpu_us_per_msg": 40.0,
        "pg_cpu_us_per_msg": None,
        "p50_ms": p50,
        "p99_ms": 9.0,
        "missing": 0,
    }


RUNS = [
    _run(1, "old", 12_000, 3.0),
    _run(1, "now", 9_000, 4.0),
    _run(2, "now", 11_000, 5.0),
    _run(2, "old", 14_000, 2.0),
    _run(3, "old", 13_000, None),  # a run whose p50 message never arrived
    _run(3, "now", 10_000, 6.0),
]


def _result(summary: dict[str, Any]) -> dict[str, Any]:
    """A versus report over RUNS against 79badb9, as versus.run returns it."""
    return {
        "rev": "79badb9",
        "commit": "79badb9f276bdaa17230cac4f336f62f79ba4f54",
        "backlog": 50_000,
        "rate": 500,
        "seconds": 5.0,
        "runs": RUNS,
        "summary": summary,
    }


def test_summary_takes_each_sides_median_and_the_ratio_of_the_medians() -> None:
    """Medians per side over the runs that have the figure; ratio = now / old; None when missing."""
    summary = versus.summary(RUNS)
    assert summary["drain_per_s"] == {"old": 13_000, "now": 10_000, "ratio": 10_000 / 13_000}
    assert summary["p50_ms"] == {"old": 2.5, "now": 5.0, "ratio": 2.0}
    assert summary["pg_cpu_us_per_msg"] == {"old": None, "now": None, "ratio": None}


def test_markdown_shows_the_medians_and_every_run() -> None:
    """The section names the commit, gives the ratio row and one line per run."""
    result = _result(versus.summary(RUNS))
    text = versus.markdown(result, {})
    assert "| drain, 1 relay (msg/s) | 13,000 | 10,000 | 0.77 |" in text
    for row in RUNS:
        code = "79badb9" if row["side"] == "old" else "this checkout"
        assert f"| {row['round']} | {code} | {row['drain_per_s']:,} |" in text


def test_versus_is_a_scenario_and_takes_its_commit() -> None:
    """`--scenarios versus --versus REV` is accepted, in quick mode too."""
    args = run.parse_args(["--quick", "--scenarios", "versus", "--versus", "v1.0"])
    assert args.scenarios == ["versus"]
    assert args.versus == "v1.0"
    assert "versus" in run.parse_args(["--quick"]).scenarios


def test_versus_rounds_is_taken_and_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    """`--versus-rounds N` reaches the scenario; 0 is refused before anything starts."""
    args = run.parse_args(["--scenarios", "versus", "--versus-rounds", "8"])
    assert args.versus_rounds == 8
    assert run.parse_args(["--scenarios", "versus"]).versus_rounds is None
    with pytest.raises(SystemExit):
        run.parse_args(["--scenarios", "versus", "--versus-rounds", "0"])
    assert "--versus-rounds must be at least 1" in capsys.readouterr().err


def test_first_messages_is_the_median_of_the_runs_head_in_commit_order() -> None:
    """The first FIRST latencies as committed, not the smallest; a lost one among them: None."""
    slow_head = [30.0 + i for i in range(versus.FIRST)]
    assert versus.first_messages([*slow_head, *([1.0] * 100)]) == 30.0 + versus.FIRST // 2
    assert versus.first_messages([]) is None
    lost = [float("inf")] * versus.FIRST
    assert versus.first_messages([*lost, 1.0]) is None


def test_a_report_saved_before_the_first_messages_figure_still_renders() -> None:
    """Runs without `first_ms` (bench/results/versus.json of earlier commits) read as n/a."""
    summary = versus.summary(RUNS)
    assert summary["first_ms"] == {"old": None, "now": None, "ratio": None}
    result = _result(summary)
    assert "| commit → broker, first 25 messages (median) | n/a | n/a | n/a |" in versus.markdown(
        result, {}
    )
