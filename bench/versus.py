"""This checkout against a previous commit: Redis drain and commit → broker latency, alternating.

The previous commit (`python -m bench.run --versus REV`, default DEFAULT_REV) is taken from the
repository's history with `git archive` and pip-installed into a virtualenv of its own under
.venv-versus/ (bench.venv.build, pinned to this interpreter's releases, reused while they stay
the same). Its processes run its own outbox_notify with this checkout's benchmark project and
helpers, against a database its own `migrate` built (the schema changes between commits).
Rounds alternate the two (previous, this checkout; then the other way round), each round one
drain of a committed backlog by one relay and one run at a fixed rate, so a machine that
slows down during the run slows both; the figures are each run's, their medians and the
ratio of the medians (this checkout / previous).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import db, drain, latency, services, venv
from bench.brokers import REDIS
from bench.procs import BenchError
from bench.setup import finish
from bench.sides import OURS, Side, World, template_from_output, with_template
from bench.tables import ms, num, table

DEFAULT_REV = "79badb9"  # the last commit before the drain got slower (issue 23)
VENVS = venv.ROOT / ".venv-versus"
SOURCE_PATHS = ("pyproject.toml", "README.md", "LICENSE", "outbox_notify", "sql")
EXTRAS = "[binary,redis,fast]"
ROUNDS = 4
QUICK_ROUNDS = 2
BACKLOG = 50_000
QUICK_BACKLOG = 20_000
RATE = 500  # messages per second of the latency runs
SECONDS = 5.0  # of each latency run
QUICK_SECONDS = 3.0
DATABASE = "outbox_bench_versus"


@dataclass(frozen=True, kw_only=True)
class Previous:
    """A previous commit's interpreter, and the PYTHONPATH that gives it this benchmark."""

    rev: str
    commit: str
    python: Path
    path: Path


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(venv.ROOT), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _commit(rev: str) -> str:
    return _git("rev-parse", "--verify", f"{rev}^{{commit}}")


def _source_paths(commit: str) -> list[str]:
    """SOURCE_PATHS that exist at the commit (older commits have no LICENSE file)."""
    present = set(_git("ls-tree", "--name-only", commit).splitlines())
    return [p for p in SOURCE_PATHS if p in present]


def prepare(rev: str) -> Previous:
    """The previous commit's venv, built once per commit and set of pinned releases."""
    commit = _commit(rev)
    VENVS.mkdir(exist_ok=True)
    pins = venv.pins(VENVS / f"{commit[:12]}.pins")
    fingerprint = hashlib.sha256(pins.read_bytes()).hexdigest()
    # One venv per commit and set of releases (.venv and .venv-bench pin different sets).
    base = VENVS / f"{commit[:12]}-{fingerprint[:8]}"
    base.mkdir(exist_ok=True)
    stamp = base / ".versus-installed"
    python = base / "venv" / "bin" / "python"
    if not (stamp.exists() and stamp.read_text() == fingerprint and python.exists()):
        print(f"bench: building {rev}'s venv in {base}", file=sys.stderr, flush=True)
        source = base / "source"
        if source.exists():
            subprocess.run(["rm", "-rf", str(source)], check=True)
        venv.archive(commit, source, _source_paths(commit))
        # packaging: kombu's Redis transport imports it; outbox-notify's extras do not pull it.
        venv.build(base / "venv", ["-c", str(pins), f"{source}{EXTRAS}", "packaging"])
        stamp.write_text(fingerprint)
    # Only the benchmark package on its path: outbox_notify comes from its venv.
    path = base / "path"
    path.mkdir(exist_ok=True)
    link = path / "bench"
    if not link.exists():
        link.symlink_to(venv.ROOT / "bench", target_is_directory=True)
    _check_own_code(python, path, base / "venv")
    return Previous(rev=rev, commit=commit, python=python, path=path)


PROBE = "import outbox_notify; print(outbox_notify.__file__)"


def _check_own_code(python: Path, path: Path, venv_dir: Path) -> None:
    """Its processes (started in `path`, with `path` on PYTHONPATH) import its own library."""
    done = subprocess.run(
        [str(python), "-c", PROBE],
        cwd=path,
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        check=False,
    )
    module = done.stdout.strip()
    if done.returncode != 0 or not Path(module).resolve().is_relative_to(venv_dir.resolve()):
        raise BenchError(f"the previous commit's python imports {module!r}: {done.stderr}")


def old_side(previous: Previous) -> Side:
    """Our library as the previous commit has it, in a database of its own."""
    return dataclasses.replace(
        OURS,
        label=previous.rev,
        python=previous.python,
        path=previous.path,
        database=DATABASE,
    )


def _run_old(world: World, side: Side, name: str, argv: list[str]) -> str:
    """Run one of the previous commit's processes to its end; its output."""
    argv = [str(side.python), *argv]
    proc = world.procs.start(name, argv, world.side_env(side), cwd=side.path)
    return finish(world, [proc], name)[0]


@contextlib.contextmanager
def old_world(world: World, previous: Previous) -> Iterator[Side]:
    """The previous commit's database, migrated by its code, with its template row."""
    side = old_side(previous)
    with services.databases(world.pg, [DATABASE]):
        _run_old(world, side, "migrate-old", ["-m", "django", "migrate", "-v", "0", "--database", "ours"])  # fmt: skip
        out = _run_old(world, side, "template-old", ["-m", "bench.workers", "template", "--side", "ours"])  # fmt: skip
        yield with_template(side, template_from_output(out))


def run(world: World, rev: str = DEFAULT_REV, rounds: int | None = None) -> dict[str, Any]:
    """Alternating rounds of drain and latency, the previous commit's relay and ours
    (`rounds`: ROUNDS, QUICK_ROUNDS in quick mode)."""
    redis = next((b for b in world.brokers if b.key == REDIS), None)
    if redis is None:
        raise BenchError(
            "the side-by-side against a previous commit runs on Redis: add it to --brokers"
        )
    world = world.on(redis)
    previous = prepare(rev)
    ours = next(s for s in world.sides if s.key == OURS.key)
    if rounds is None:
        rounds = QUICK_ROUNDS if world.quick else ROUNDS
    runs: list[dict[str, Any]] = []
    with old_world(world, previous) as old:
        for rnd in range(rounds):
            pair = (old, ours) if rnd % 2 == 0 else (ours, old)
            for side in pair:
                runs.append(one_run(world, side, "old" if side is old else "now", rnd + 1))
    return {
        "rev": rev,
        "commit": previous.commit,
        "backlog": QUICK_BACKLOG if world.quick else BACKLOG,
        "rate": RATE,
        "seconds": QUICK_SECONDS if world.quick else SECONDS,
        "runs": runs,
        "summary": summary(runs),
    }


def one_run(world: World, side: Side, which: str, rnd: int) -> dict[str, Any]:
    """One drain and one latency run of one side; printed as it ends."""
    backlog = QUICK_BACKLOG if world.quick else BACKLOG
    drained = drain.one_drain(world, side, 1, backlog)
    seconds = QUICK_SECONDS if world.quick else SECONDS
    timed = latency.one_round(world, side, (RATE,), seconds)[RATE]
    in_commit_order = timed.pop("latencies_ms")
    ordered = sorted(in_commit_order)
    row = {
        "round": rnd,
        "side": which,
        "drain_per_s": drained["per_s"],
        "relay_cpu_us_per_msg": drained["relay_cpu_us_per_msg"],
        "pg_cpu_us_per_msg": drained["pg_cpu_us_per_msg"],
        "p50_ms": timed["p50_ms"],
        "p99_ms": latency.percentile(ordered, 99) if ordered else None,
        "first_ms": first_messages(in_commit_order),
        "missing": timed["missing"],
    }
    db.reset(world, side)
    print(
        f"bench: versus round {rnd} {side.label:>12}: drain {row['drain_per_s']:,.0f} msg/s,"
        f" CPU/msg relay {num(row['relay_cpu_us_per_msg'])} µs,"
        f" PostgreSQL {num(row['pg_cpu_us_per_msg'])} µs; at {RATE} msg/s p50 {ms(row['p50_ms'])}"
        f" p99 {ms(row['p99_ms'])}, first {FIRST} {ms(row['first_ms'])}",
        file=sys.stderr,
        flush=True,
    )
    return row


FIGURES = (
    "drain_per_s",
    "relay_cpu_us_per_msg",
    "pg_cpu_us_per_msg",
    "p50_ms",
    "p99_ms",
    "first_ms",
)
FIRST = 25  # messages: the first 1 % of a latency run, committed right after the relay started


def first_messages(in_commit_order: list[float]) -> float | None:
    """Median latency of the latency run's FIRST messages (the relay had just started: its
    first batches pay for first uses); None when one of them never arrived."""
    head = sorted(in_commit_order[:FIRST])
    if not head or math.isinf(head[len(head) // 2]):
        return None
    return statistics.median(head)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median per side, and the ratio now / old of the medians."""
    medians: dict[str, Any] = {}
    for figure in FIGURES:
        values = {
            which: [r[figure] for r in runs if r["side"] == which and r.get(figure) is not None]
            for which in ("old", "now")
        }
        old, now = (statistics.median(v) if v else None for v in values.values())
        medians[figure] = {"old": old, "now": now, "ratio": now / old if old and now else None}
    return medians


LABELS = {
    "drain_per_s": "drain, 1 relay (msg/s)",
    "relay_cpu_us_per_msg": "relay CPU per message (µs)",
    "pg_cpu_us_per_msg": "PostgreSQL CPU per message (µs)",
    "p50_ms": "commit → broker p50",
    "p99_ms": "commit → broker p99",
    "first_ms": f"commit → broker, first {FIRST} messages (median)",
}


def _figure(figure: str, value: float | None) -> str:
    return ms(value) if figure.endswith("_ms") else num(value)


def markdown(result: dict[str, Any], sides: dict[str, str] | None = None) -> str:
    """The medians side by side, then every run."""
    rev, rate = result["rev"], result["rate"]
    head = [
        f"Redis; previous commit `{rev}` ({result['commit'][:12]}) against this checkout, "
        f"alternating; backlog {result['backlog']:,}, latency at {rate} msg/s for "
        f"{result['seconds']:.0f} s. Ratio: this checkout / `{rev}`.\n"
    ]
    medians = [
        [LABELS[f], _figure(f, m["old"]), _figure(f, m["now"]), _ratio(m["ratio"])]
        for f, m in result["summary"].items()
    ]
    head.append(table(["median", f"`{rev}`", "this checkout", "ratio"], medians))
    runs = [
        [str(r["round"]), rev if r["side"] == "old" else "this checkout"]
        + [_figure(f, r.get(f)) for f in FIGURES]
        for r in result["runs"]
    ]
    head.append(table(["round", "code", *(LABELS[f] for f in FIGURES)], runs))
    return "\n".join(head)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
