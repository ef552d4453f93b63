"""End-to-end demo of outbox-notify: `python -m example.demo` (or `make demo`).

Starts (or uses) PostgreSQL and a broker, migrates the example project, runs the relay
(`manage.py outbox_listen`) and a Celery worker, places orders in transactions (some rolled
back), shows progress, then prints a summary. Exit status 0 only when every committed order
was executed and no rolled-back one was. Ctrl-C or SIGTERM stops everything it started.
See docs/demo.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from example.demokit import orders, processes, report, services

ROOT = processes.ROOT
WORKER_CONCURRENCY = 2
TICK = 0.25  # seconds between progress updates
MISSING_SHOWN = 20  # order ids listed when some never ran
SETTLE = 0.5  # seconds to keep watching after the last order ran, for stray executions
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see docs/demo.md)."""
    parser = argparse.ArgumentParser(prog="python -m example.demo", description=__doc__)
    parser.add_argument("--orders", type=int, default=200, help="orders to place (200)")
    parser.add_argument(
        "--rollback-share", type=float, default=0.25, help="share rolled back, 0..1 (0.25)"
    )
    parser.add_argument("--rate", type=float, default=50.0, help="orders per second (50)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the last executions after the last order (60)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the rollback choice")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the private PostgreSQL running and keep the logs",
    )
    parser.add_argument(
        "--no-redis",
        action="store_true",
        default=_truthy("DEMO_NO_REDIS"),
        help="never use Redis: kombu's filesystem transport (also DEMO_NO_REDIS=1)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("DEMO_REDIS_URL", services.DEFAULT_REDIS_URL),
        help="the Redis to probe when CELERY_BROKER_URL is unset (also DEMO_REDIS_URL)",
    )
    args = parser.parse_args(argv)
    if args.orders < 1 or args.rate <= 0 or args.timeout <= 0:
        parser.error("--orders, --rate and --timeout must be positive")
    if not 0.0 <= args.rollback_share <= 1.0:
        parser.error("--rollback-share must be between 0 and 1")
    return args


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Demo:
    """One run: everything it starts is recorded so that cleanup() can undo it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
        self.logdir = Path(tempfile.mkdtemp(prefix="outbox-demo-logs-"))
        self.services: services.Services | None = None
        self.children: list[processes.ManagedProcess] = []
        self.producer: orders.Producer | None = None
        self.ledger = orders.Ledger()
        self.django_ready = False
        self.orders_started = self.started
        self.keep_logs = args.keep

    # -- set-up ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Resolve services, set Django up on them, migrate, start relay and worker."""
        print("outbox-notify demo")
        self.services = services.resolve(
            self.workdir,
            keep=self.args.keep,
            use_redis=not self.args.no_redis,
            redis_url=self.args.redis_url,
        )
        found = self.services
        print(f"  database  {services.shown(found.database_url)}  ({found.database_note})")
        print(f"  broker    {services.shown(found.broker_url)}  ({found.broker_note})")
        kept = "kept (--keep)" if self.args.keep else "removed after a clean run"
        print(f"  logs      {self.logdir}  ({kept})")
        os.environ.update(self.settings_env(self.services))
        self.migrate()
        self.start_children(self.child_env())

    def settings_env(self, found: services.Services) -> dict[str, str]:
        """The variables example/project/settings.py reads, for this run."""
        return {
            "DJANGO_SETTINGS_MODULE": "example.project.settings",
            "DATABASE_URL": found.database_url,
            "SHOP_PUBLISH_EVENTS": "1" if self.events_possible(found) else "0",
            **found.broker_env,
        }

    @staticmethod
    def events_possible(found: services.Services) -> bool:
        """Whether events can route: not on kombu's filesystem transport, whose exchange
        bindings live inside each process (the relay would never see the consumer's)."""
        return not found.broker_url.startswith("filesystem:")

    def child_env(self) -> dict[str, str]:
        """Environment of the relay and the worker: ours, which has the settings' variables."""
        env = dict(os.environ)
        path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def migrate(self) -> None:
        """Set Django up in this process and apply the migrations."""
        import django
        from django.core.management import call_command

        began = time.monotonic()
        django.setup()
        self.django_ready = True
        with (self.logdir / "migrate.log").open("w") as log:
            call_command("migrate", interactive=False, verbosity=1, stdout=log)
        print(f"  migrate   done in {time.monotonic() - began:.1f} s")

    def start_children(self, env: dict[str, str]) -> None:
        """Start the relay and the worker; return once both are ready."""
        from django.conf import settings

        alive = self.workdir / "relay.alive"
        ready = self.workdir / "worker.ready"
        relay = self.spawn("relay (manage.py outbox_listen)", processes.relay_argv(alive), env)
        worker_env = {**env, "EXAMPLE_WORKER_READY_FILE": str(ready)}
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        argv = processes.worker_argv(queue, WORKER_CONCURRENCY)
        worker = self.spawn("celery worker", argv, worker_env)
        relay.wait_ready(alive)
        print(f"  relay     running, pid {relay.pid}")
        worker.wait_ready(ready)
        print(f"  worker    running, pid {worker.pid} (prefork x{WORKER_CONCURRENCY}, -Q {queue})")
        if settings.SHOP_PUBLISH_EVENTS:
            self.start_consumer(env)
        else:
            print("  consumer  not started: events need Redis or RabbitMQ (see docs/demo.md)")

    def start_consumer(self, env: dict[str, str]) -> None:
        """Declare the consumer's queue and bindings here (so no event published from now on
        can miss it), then start `manage.py outbox_consume`."""
        from example.demokit.consumer import declare_queue

        queue = declare_queue()
        consumer = self.spawn("consumer (manage.py outbox_consume)", processes.consumer_argv(), env)
        print(f"  consumer  running, pid {consumer.pid} (queue {queue}, OrderPlaced events)")

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> processes.ManagedProcess:
        """Start one subprocess with its output in the log folder."""
        log_name = name.split(" ", maxsplit=1)[0] + ".log"
        child = processes.start(name, argv, env, self.logdir / log_name)
        self.children.append(child)
        return child

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        """Place the orders, wait for their executions, print the summary; the exit status."""
        self.prepare()
        planned = orders.tickets(self.args.orders, self.args.rollback_share, self.args.seed)
        print(
            f"placing {len(planned)} orders at {self.args.rate:g}/s, "
            f"{self.args.rollback_share:.0%} of them rolled back"
        )
        self.ledger.executions_before = report.last_execution_id()
        self.ledger.receipts_before = report.last_receipt_id()
        from django.conf import settings

        self.ledger.events = settings.SHOP_PUBLISH_EVENTS
        self.producer = orders.Producer(planned, self.args.rate, self.ledger)
        line = report.ProgressLine()
        self.orders_started = time.monotonic()
        self.producer.start()
        producer = self.producer
        self.watch(line, len(planned), until=lambda now: producer.done())
        self.await_executions(line, len(planned))
        return self.conclude()

    def watch(
        self, line: report.ProgressLine, planned: int, until: Callable[[report.Progress], bool]
    ) -> report.Progress:
        """Redraw the progress line every tick until `until(progress)` is true."""
        while True:
            self.check_children()
            now = report.progress(self.ledger, planned, self.orders_started)
            line.show(now)
            if until(now):
                return now
            time.sleep(TICK)

    def await_executions(self, line: report.ProgressLine, planned: int) -> None:
        """Wait (up to --timeout) until every committed order has been executed."""
        deadline = time.monotonic() + self.args.timeout
        last = self.watch(
            line,
            planned,
            until=lambda now: now.caught_up or time.monotonic() > deadline,
        )
        if not last.caught_up:
            line.end()
            print(
                f"gave up waiting after {self.args.timeout:g} s: some orders or events never arrived"
            )
            return
        time.sleep(SETTLE)
        line.show(report.progress(self.ledger, planned, self.orders_started), force=True)
        line.end()

    def check_children(self) -> None:
        """Raise if the relay or the worker has exited."""
        for child in self.children:
            if not child.alive():
                raise child.failure("stopped during the run")

    def conclude(self) -> int:
        """Print the summary (and what is missing, if anything); the exit status."""
        summary = report.summarise(self.ledger)
        print(report.render(summary))
        if summary.missing:
            shown = ", ".join(str(i) for i in summary.missing[:MISSING_SHOWN])
            more = ", ..." if len(summary.missing) > MISSING_SHOWN else ""
            print(f"orders never executed ({len(summary.missing)}): {shown}{more}")
        for error in self.ledger.errors[:10]:
            print(f"order error: {error}")
        if not summary.ok:
            self.keep_logs = True
        return EXIT_OK if summary.ok else EXIT_FAILED

    # -- clean-up ----------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Stop and remove everything this run started; ignores further Ctrl-C meanwhile."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        notes: list[str] = []
        if self.producer is not None:
            self.producer.cancel()
        notes += processes.stop_all(self.children)
        if self.django_ready:
            from django.db import connections

            connections.close_all()
        if self.services is not None:
            notes += self.services.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.keep_logs:
            notes.append(f"logs kept in {self.logdir}")
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)
        for note in notes:
            print(note)
        print(f"done in {time.monotonic() - self.started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; the process exit status."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    demo = Demo(args)
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything the demo started")
        return EXIT_INTERRUPTED
    except (services.ServiceError, processes.ProcessFailed) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        demo.keep_logs = True
        return EXIT_ERROR
    except Exception:
        demo.keep_logs = True
        traceback.print_exc()
        return EXIT_ERROR
    finally:
        demo.cleanup()


if __name__ == "__main__":
    sys.exit(main())
