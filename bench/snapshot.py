"""An old snapshot held open under sustained load: latency, relay CPU and table size per interval.

    python -m bench.snapshot [--minutes 10] [--relays 1,2] [--rate 2000] [--clean 2]
                             [--recovery 5] [--peer-minutes 3] [--no-peer] [--quick]
                             [--json PATH] [--plot PATH]

Three phases on Redis, per side and relay count: `clean` (no snapshot), `held` (a REPEATABLE
READ transaction on another connection read the outbox table and stays open: no row deleted
since can be vacuumed away), `recovery` (the snapshot released, the load goes on). The load is
--rate rows per second committed 10 per transaction (bench.sustained); our relay runs with
--batch-size 500, the peer (django-celery-outbox 0.4.3) with its defaults and --peer-minutes
of held snapshot. Printed per interval: commit -> broker p50/p99, table + index size, dead
rows; per phase: the same plus relay CPU per message published. Verdicts (ours): p50 and p99
of the held phase within 2x of the clean phase's, CPU per message within 1.2x, and the table's
size at the end of the recovery phase within 1.2x of its size at the end of the clean phase.
`bench.run` runs it as the `snapshot` scenario (full: the defaults above; --quick: seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import sustained
from bench.sides import World

WINDOW = 10.0  # seconds per interval
QUICK_WINDOW = 1.0
BATCH_SIZE = 500
PER_TX = 10
LATENCY_LIMIT = 2.0  # held / clean, p50 and p99
CPU_LIMIT = 1.2  # held / clean, relay CPU per message
SIZE_LIMIT = 1.2  # end of recovery / end of clean, table + indexes
PEER_HELD = 180.0  # seconds of held snapshot for the peer in full mode


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Seconds per phase, rows per second, and our relay counts."""

    clean: float
    held: float
    recovery: float
    rate: int
    relays: tuple[int, ...] = (1, 2)


QUICK = Shape(clean=3.0, held=4.0, recovery=3.0, rate=300)
# Recovery: two autovacuum rounds (the dead rows, then the table's empty tail) and the relay's
# index keeper's next look (docs/operations.md) take three to four minutes after a 10-minute
# snapshot.
FULL = Shape(clean=120.0, held=600.0, recovery=300.0, rate=2000)


def plan(clean: float, held: float, recovery: float, rate: int, window: float) -> sustained.Plan:
    return sustained.Plan(
        phases=(
            sustained.Phase(name="clean", seconds=clean),
            sustained.Phase(name="held", seconds=held, hold=True),
            sustained.Phase(name="recovery", seconds=recovery),
        ),
        rate=rate,
        per_tx=PER_TX,
        window=window,
        batch_size=BATCH_SIZE,
        catch_up=max(10.0, min(60.0, recovery)),
    )


def run(world: World) -> dict[str, Any]:
    """bench.run's `snapshot` scenario: ours with 1 and 2 relays, then the peer (1 relay)."""
    shape = QUICK if world.quick else FULL
    window = QUICK_WINDOW if world.quick else WINDOW
    ours = plan(shape.clean, shape.held, shape.recovery, shape.rate, window)
    peer_held = shape.held if world.quick else PEER_HELD
    peer = plan(shape.clean, peer_held, shape.recovery, shape.rate, window)
    return scenario(world, ours, peer, shape.relays)


def scenario(
    world: World, ours: sustained.Plan, peer: sustained.Plan, relays: Sequence[int]
) -> dict[str, Any]:
    """Every run, summarised; the peer only when the world has it."""
    runs = []
    for side in world.sides:
        counts = relays if side.key == "ours" else (1,)
        chosen = ours if side.key == "ours" else peer
        for count in counts:
            runs.append(summarise(sustained.run(world, side, count, chosen), chosen))
            print(lines(runs[-1]), file=sys.stderr, flush=True)
    return {"broker": world.broker.key, "per_tx": PER_TX, "batch_size": BATCH_SIZE, "runs": runs}


def summarise(raw: dict[str, Any], chosen: sustained.Plan) -> dict[str, Any]:
    """The figures of one run, and its verdicts."""
    by_phase = sustained.phases(raw, chosen)
    clean, held, recovery = by_phase["clean"], by_phase["held"], by_phase["recovery"]
    figures = {
        "side": raw["side"],
        "relays": raw["relays"],
        "rate": chosen.rate,
        "window_s": chosen.window,
        "phases": by_phase,
        "windows": sustained.windows(raw, chosen.window),
        "left_in_table": raw["left_in_table"],
        "after": raw["samples"][-1],
        "ratios": {
            "p50": sustained.ratio(held["p50_ms"], clean["p50_ms"]),
            "p99": sustained.ratio(held["p99_ms"], clean["p99_ms"]),
            "cpu_per_msg": sustained.ratio(held["cpu_ms_per_msg"], clean["cpu_ms_per_msg"]),
            "size_after": sustained.ratio(recovery["end_total_bytes"], clean["end_total_bytes"]),
            "size_reindexed": sustained.ratio(_reindexed_bytes(raw), clean["end_total_bytes"]),
        },
    }
    figures["verdicts"] = verdicts(figures["ratios"])
    return figures


def _reindexed_bytes(raw: dict[str, Any]) -> int | None:
    """Table and indexes once `outbox_reindex` ran after the catch-up (ours only)."""
    found = [s["total_bytes"] for s in raw["samples"] if s["phase"] == "reindexed"]
    return found[-1] if found else None


def verdicts(ratios: dict[str, float | None]) -> dict[str, bool]:
    """A ratio that could not be computed (nothing delivered) fails; the size after
    `outbox_reindex` is judged only where it ran (ours)."""
    limits = {"p50": LATENCY_LIMIT, "p99": LATENCY_LIMIT, "cpu_per_msg": CPU_LIMIT,
              "size_after": SIZE_LIMIT, "size_reindexed": SIZE_LIMIT}  # fmt: skip
    return {key: _within(ratios[key], limit) for key, limit in limits.items()}


def _within(value: float | None, limit: float) -> bool:
    return value is not None and value <= limit


def _cpu(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _ms(value: float | None) -> str:
    return "not delivered" if value is None else f"{value:.1f}"


def lines(run: dict[str, Any]) -> str:
    """The terminal lines of one run: per interval, per phase, the verdicts."""
    head = f"snapshot: {run['side']}, {run['relays']} relay(s), {run['rate']} msg/s"
    out = [head, "  t(s) phase     msgs  p50ms  p99ms  size MB  dead rows"]
    for w in run["windows"]:
        out.append(
            f"  {w['t_s']:5.0f} {w['phase']:<9} {w['messages']:5d} {_ms(w['p50_ms']):>6} "
            f"{_ms(w['p99_ms']):>6} {_mb(w['total_bytes']):>8} {w['dead_rows']:>10}"
        )
    out.append(markdown_phases(run))
    out.append(verdict_line(run))
    return "\n".join(out)


def verdict_line(run: dict[str, Any]) -> str:
    r, v = run["ratios"], run["verdicts"]
    parts = [
        f"p50 held/clean {r['p50']}x (<= {LATENCY_LIMIT}: {'pass' if v['p50'] else 'FAIL'})",
        f"p99 {r['p99']}x (<= {LATENCY_LIMIT}: {'pass' if v['p99'] else 'FAIL'})",
        f"CPU/msg {r['cpu_per_msg']}x (<= {CPU_LIMIT}: {'pass' if v['cpu_per_msg'] else 'FAIL'})",
        f"size after recovery/clean {r['size_after']}x "
        f"(<= {SIZE_LIMIT}: {'pass' if v['size_after'] else 'FAIL'})",
    ]
    if r.get("size_reindexed") is not None:
        parts.append(
            f"size after outbox_reindex/clean {r['size_reindexed']}x "
            f"(<= {SIZE_LIMIT}: {'pass' if v['size_reindexed'] else 'FAIL'})"
        )
    return f"verdict {run['side']} x{run['relays']}: " + "; ".join(parts)


def markdown_phases(run: dict[str, Any]) -> str:
    rows = ["| phase | s | messages | not delivered | p50 ms | p99 ms | writer lag p99 ms "
            "| relay CPU ms/msg | PostgreSQL CPU ms/msg | size at end MB | max size MB "
            "| dead rows at end |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, p in run["phases"].items():
        cpu = _cpu(p["cpu_ms_per_msg"])
        server = _cpu(p.get("server_cpu_ms_per_msg"))
        rows.append(
            f"| {name} | {p['seconds']:.0f} | {p['messages']:,} | {p['missing']:,} "
            f"| {_ms(p['p50_ms'])} | {_ms(p['p99_ms'])} | {_ms(p['producer_lag_p99_ms'])} "
            f"| {cpu} | {server} | {_mb(p['end_total_bytes'])} | {_mb(p['max_total_bytes'])} "
            f"| {p['end_dead_rows']:,} |"
        )
    return "\n".join(rows)


def markdown(result: dict[str, Any], sides: dict[str, str] | None = None) -> str:
    """The docs/benchmarks.md section of a scenario's figures."""
    labels = sides or {"ours": "outbox-notify", "peer": "django-celery-outbox 0.4.3"}
    parts = [
        f"Rows committed {result['per_tx']} per transaction at a steady rate on "
        f"{result['broker'].capitalize()}; our relay at `--batch-size {result['batch_size']}`. "
        "Phases: clean table, then a REPEATABLE READ transaction that read the outbox table "
        "stays open (held), then it ends and the load goes on (recovery). Latency is commit "
        "-> broker of the messages committed in the phase; relay CPU is per message published "
        "in the phase (/proc/PID/stat); size is the table with its indexes and TOAST.\n"
    ]
    for run in result["runs"]:
        title = f"### {labels.get(run['side'], run['side'])}, {run['relays']} relay(s), " \
            f"{run['rate']:,} msg/s\n"  # fmt: skip
        left = f"\nLeft in the table after the catch-up: {run['left_in_table']:,} rows.\n"
        parts.append(f"{title}\n{markdown_phases(run)}\n{left}\n{verdict_line(run)}\n")
    return "\n".join(parts)


def plot(result: dict[str, Any], out: Path) -> bool:
    """p50/p99 and table size per interval, one column per run (matplotlib, when installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.6 * len(runs), 6), squeeze=False)
    for column, run in enumerate(runs):
        _panel(axes[0][column], axes[1][column], run)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def _panel(top: Any, bottom: Any, run: dict[str, Any]) -> None:
    ws = run["windows"]
    xs = [w["t_s"] for w in ws]
    for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
        top.plot(xs, [w[key] if w[key] is not None else float("nan") for w in ws], style,
                 label=key.replace("_ms", ""))  # fmt: skip
    top.set_yscale("log")
    top.set_title(f"{run['side']}, {run['relays']} relay(s), {run['rate']} msg/s", fontsize=9)
    top.set_ylabel("commit → broker (ms)")
    top.legend(fontsize=7)
    bottom.plot(xs, [w["total_bytes"] / 1e6 for w in ws], label="table + indexes (MB)")
    bottom.set_ylabel("MB")
    bottom.set_xlabel("seconds")
    twin = bottom.twinx()
    twin.plot(xs, [w["dead_rows"] for w in ws], color="grey", alpha=0.6, label="dead rows")
    twin.set_ylabel("dead rows")
    for ax in (top, bottom):
        _shade_held(ax, ws)
        ax.grid(True, alpha=0.3)


def _shade_held(ax: Any, ws: list[dict[str, Any]]) -> None:
    held = [w["t_s"] for w in ws if w["phase"] == "held"]
    if held:
        ax.axvspan(min(held) - ws[0]["t_s"], max(held), color="orange", alpha=0.12)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__)
    parser.add_argument("--minutes", type=float, default=FULL.held / 60, help="held snapshot")
    parser.add_argument("--clean", type=float, default=FULL.clean / 60, help="minutes")
    parser.add_argument("--recovery", type=float, default=FULL.recovery / 60, help="minutes")
    parser.add_argument("--peer-minutes", type=float, default=PEER_HELD / 60)
    parser.add_argument("--relays", default="1,2", help="our relay counts, comma-separated")
    parser.add_argument("--rate", type=int, default=FULL.rate, help="rows per second")
    parser.add_argument("--window", type=float, default=WINDOW, help="seconds per interval")
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    parser.add_argument("--quick", action="store_true", help="seconds per phase (CI)")
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
        if args.quick:
            result = run(world)
        else:
            m = 60.0
            ours = plan(args.clean * m, args.minutes * m, args.recovery * m, args.rate, args.window)
            peer = plan(args.clean * m, args.peer_minutes * m, args.recovery * m, args.rate,
                        args.window)  # fmt: skip
            relays = [int(n) for n in args.relays.split(",")]
            result = scenario(world, ours, peer, relays)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
