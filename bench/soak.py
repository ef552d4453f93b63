"""A soak: one relay under a steady rate for 30 minutes, sampled every minute.

    python -m bench.soak [--minutes 30] [--rate 500] [--window 60] [--no-peer] [--quick]
                         [--json PATH] [--plot PATH]

Rows committed 10 per transaction at --rate on Redis (bench.sustained), one relay per side
(ours at --batch-size 500, the peer with its defaults). Printed per interval: commit ->
broker p50/p99, the relay's RSS, the table's size (with indexes and TOAST) and its dead rows;
then how the relay's RSS and the table's size moved from the first interval to the last.
`bench.run` runs it as the `soak` scenario (full: 30 minutes; --quick: 10 seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import sustained
from bench.sides import World
from bench.snapshot import BATCH_SIZE, PER_TX

MINUTES = 30.0
RATE = 500  # rows per second: steady, well under one relay's drain rate
WINDOW = 60.0  # seconds per interval
QUICK_SECONDS = 10.0
QUICK_RATE = 200
QUICK_WINDOW = 2.0


def plan(seconds: float, rate: int, window: float) -> sustained.Plan:
    return sustained.Plan(
        phases=(sustained.Phase(name="steady", seconds=seconds),),
        rate=rate,
        per_tx=PER_TX,
        window=window,
        batch_size=BATCH_SIZE,
        catch_up=30.0,
    )


def run(world: World) -> dict[str, Any]:
    """bench.run's `soak` scenario: every side, one relay each."""
    if world.quick:
        return scenario(world, plan(QUICK_SECONDS, QUICK_RATE, QUICK_WINDOW))
    return scenario(world, plan(MINUTES * 60, RATE, WINDOW))


def scenario(world: World, chosen: sustained.Plan) -> dict[str, Any]:
    runs = []
    for side in world.sides:
        runs.append(summarise(sustained.run(world, side, 1, chosen), chosen))
        print(lines(runs[-1]), file=sys.stderr, flush=True)
    return {"broker": world.broker.key, "per_tx": PER_TX, "batch_size": BATCH_SIZE, "runs": runs}


def summarise(raw: dict[str, Any], chosen: sustained.Plan) -> dict[str, Any]:
    ws = [w for w in sustained.windows(raw, chosen.window) if w["phase"] == "steady"]
    steady = sustained.phases(raw, chosen)["steady"]
    first, last = (ws[0], ws[-1]) if ws else ({}, {})
    return {
        "side": raw["side"],
        "relays": raw["relays"],
        "rate": chosen.rate,
        "window_s": chosen.window,
        "seconds": chosen.seconds,
        "steady": steady,
        "windows": ws,
        "left_in_table": raw["left_in_table"],
        "rss_first_mb": round(first.get("relay_rss_bytes", 0) / 1e6, 1),
        "rss_last_mb": round(last.get("relay_rss_bytes", 0) / 1e6, 1),
        "size_first_mb": round(first.get("total_bytes", 0) / 1e6, 2),
        "size_last_mb": round(last.get("total_bytes", 0) / 1e6, 2),
        "size_max_mb": round(max((w["total_bytes"] for w in ws), default=0) / 1e6, 2),
    }


def _ms(value: float | None) -> str:
    return "not delivered" if value is None else f"{value:.1f}"


def table(run: dict[str, Any]) -> str:
    rows = ["| t (s) | messages | not delivered | p50 ms | p99 ms | relay RSS MB | size MB "
            "| dead rows |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in run["windows"]:
        rows.append(
            f"| {w['t_s']:.0f} | {w['messages']:,} | {w['missing']:,} | {_ms(w['p50_ms'])} "
            f"| {_ms(w['p99_ms'])} | {w['relay_rss_bytes'] / 1e6:.1f} "
            f"| {w['total_bytes'] / 1e6:.2f} | {w['dead_rows']:,} |"
        )
    return "\n".join(rows)


def summary_line(run: dict[str, Any]) -> str:
    s = run["steady"]
    cpu = "-" if s["cpu_ms_per_msg"] is None else f"{s['cpu_ms_per_msg']:.3f}"
    return (
        f"soak {run['side']}: {run['seconds'] / 60:.1f} min at {run['rate']} msg/s: p50 "
        f"{_ms(s['p50_ms'])} ms, p99 {_ms(s['p99_ms'])} ms, not delivered {s['missing']:,}; "
        f"relay CPU {cpu} ms/msg; relay RSS {run['rss_first_mb']} -> {run['rss_last_mb']} MB; "
        f"table {run['size_first_mb']} -> {run['size_last_mb']} MB (max {run['size_max_mb']})"
    )


def lines(run: dict[str, Any]) -> str:
    return f"{table(run)}\n{summary_line(run)}"


def markdown(result: dict[str, Any], sides: dict[str, str] | None = None) -> str:
    """The docs/benchmarks.md section of a soak's figures."""
    labels = sides or {"ours": "outbox-notify", "peer": "django-celery-outbox 0.4.3"}
    parts = [
        f"One relay per library under a steady rate, rows committed {result['per_tx']} per "
        f"transaction, on {result['broker'].capitalize()}; our relay at `--batch-size "
        f"{result['batch_size']}`. Per interval of commit time: commit -> broker p50/p99, the "
        "relay's RSS, the table's size (with indexes and TOAST) and its dead rows at the "
        "interval's end.\n"
    ]
    for run in result["runs"]:
        parts.append(
            f"### {labels.get(run['side'], run['side'])}\n\n{table(run)}\n\n{summary_line(run)}\n"
        )
    return "\n".join(parts)


def plot(result: dict[str, Any], out: Path) -> bool:
    """Latency, RSS, size and dead rows per interval, one row of panels per side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, run in enumerate(runs):
        ws = run["windows"]
        xs = [w["t_s"] / 60 for w in ws]
        nan = float("nan")
        for key in ("p50_ms", "p99_ms"):
            axes[row][0].plot(xs, [w[key] if w[key] is not None else nan for w in ws],
                              label=key.replace("_ms", ""))  # fmt: skip
        axes[row][0].set_yscale("log")
        axes[row][0].set_ylabel("commit → broker (ms)")
        axes[row][0].legend(fontsize=7)
        axes[row][0].set_title(f"{run['side']}, {run['rate']} msg/s", fontsize=9)
        axes[row][1].plot(xs, [w["relay_rss_bytes"] / 1e6 for w in ws])
        axes[row][1].set_ylabel("relay RSS (MB)")
        axes[row][2].plot(xs, [w["total_bytes"] / 1e6 for w in ws], label="size (MB)")
        axes[row][2].set_ylabel("table + indexes (MB)")
        twin = axes[row][2].twinx()
        twin.plot(xs, [w["dead_rows"] for w in ws], color="grey", alpha=0.6)
        twin.set_ylabel("dead rows")
        for ax in axes[row]:
            ax.set_xlabel("minutes")
            ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=MINUTES)
    parser.add_argument("--rate", type=int, default=RATE, help="rows per second")
    parser.add_argument("--window", type=float, default=WINDOW, help="seconds per interval")
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    parser.add_argument("--quick", action="store_true", help="10 seconds (CI)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--work-dir", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from bench import run as runner
    from bench import setup

    with (
        runner.work_dir(args.work_dir) as folder,
        setup.world(folder, peer=args.peer, quick=args.quick, brokers=["redis"]) as world,
    ):
        chosen = plan(args.minutes * 60, args.rate, args.window)
        result = run(world) if args.quick else scenario(world, chosen)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
