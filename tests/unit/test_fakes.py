"""The shipped fakes (outbox_notify.fakes) keep step with the relay's real store."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from outbox_notify import sql
from outbox_notify.fakes import FakeClock, FakeListener, InMemoryStore, claimed_row
from outbox_notify.relay.frontier import Frontier
from outbox_notify.relay.listener import LockState
from outbox_notify.relay.store import Dead, Outcome, Retry

ROOT = Path(__file__).resolve().parents[2]
RELAY = ROOT / "outbox_notify" / "relay"


def queries_run_by(module: str) -> set[str]:
    """The names in every `self.queries[...]` of a relay module, both sides of an `if`."""
    found = set()
    for node in ast.walk(ast.parse((RELAY / module).read_text())):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "queries"
        ):
            found |= {
                name.value
                for name in ast.walk(node.slice)
                if isinstance(name, ast.Constant) and isinstance(name.value, str)
            }
    return found


def twins() -> dict[str, inspect.Signature]:
    """The in-memory store's query methods, by query name."""
    prefix = "query_"
    return {
        name.removeprefix(prefix): inspect.signature(method)
        for name, method in vars(InMemoryStore).items()
        if name.startswith(prefix)
    }


def test_every_query_the_store_runs_has_an_in_memory_twin() -> None:
    """The real store and the in-memory one run the same named queries, all in queries.sql."""
    real = queries_run_by("store.py")
    assert len(real) > 10  # the parse found them
    assert set(twins()) == real
    assert real <= set(sql.queries())


def test_each_twin_takes_the_parameters_of_its_query() -> None:
    """A twin names only placeholders of its query and takes all of them (`**frontier`: the
    frontier's)."""
    queries = sql.queries()
    frontier = set(Frontier().params())
    for name, signature in twins().items():
        params = signature.parameters.values()
        named = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        rest = frontier if any(p.name == "frontier" for p in params) else set()
        placeholders = set(re.findall(r"%\((\w+)\)s", queries[name]))
        assert named <= placeholders, name
        assert placeholders <= named | rest, name


def test_finishing_a_claim_runs_the_queries_the_real_store_runs() -> None:
    """Published rows only: delete_published; with a retry or a dead row: finalize_batch."""
    store = InMemoryStore([claimed_row(n) for n in (1, 2, 3)])
    with store.claim(10) as claim:
        claim.finish(Outcome(published=[1]))
    assert store.ran == ["set_claim_timeout", "claim_batch", "delete_published"]
    store.ran.clear()
    with store.claim(10, lock_wait=0.5) as claim:
        retry = Retry(id=2, retries=1, delay=1.0, error="e")
        claim.finish(Outcome(retry=[retry], dead=[Dead(id=3, retries=5, reason="r")]))
    assert store.ran == [
        "set_claim_timeout",
        "set_claim_lock_wait",
        "claim_batch",
        "reset_claim_lock_wait",
        "reset_claim_statement_timeout",
        "finalize_batch",
    ]
    assert store.rows == []


def listener_queries(*, bounded: bool) -> list[str]:
    """The queries a fake listener records when every one of its methods runs."""
    listener = FakeListener(
        clock=FakeClock(),
        store=InMemoryStore(),
        locks=[LockState.HELD, LockState.WRITERS],
        bounded=bounded,
    )
    listener.listen()
    listener.probe(lambda payload: None)
    listener.take_lock()
    listener.release_lock()
    listener.take_lock()
    listener.await_writers()
    listener.lock_holder()
    listener.peek()
    return listener.ran


def test_every_query_the_listener_runs_has_a_twin_in_the_fake_listener() -> None:
    """The fake listener records every named query of relay/listener.py, and only those."""
    real = queries_run_by("listener.py")
    assert len(real) > 10  # the parse found them
    assert set(listener_queries(bounded=True) + listener_queries(bounded=False)) == real
    assert real <= set(sql.queries())


def docs_example() -> str:
    """The Python block of the reference's section on the fakes."""
    text = (ROOT / "docs" / "reference.md").read_text()
    section = text.split("### Without PostgreSQL: `outbox_notify.fakes`", 1)[1].split("\n#", 1)[0]
    [block] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_documented_example_runs_without_django_settings() -> None:
    """The reference's unit-test example passes in a process with no Django settings."""
    script = docs_example() + "\ntest_a_refused_message_is_retried_later()\nprint('ok')\n"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "ok"
