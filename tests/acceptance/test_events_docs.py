"""docs/events.md's publisher and consumer, run as written: a relay and `outbox_consume` between them.

The page's code blocks marked `<!-- events-example: PATH -->` are written to PATH in a
throwaway directory and imported from there, unchanged but for two kinds of names: each
exchange name and the consumer's name are replaced by names unique to the run (equal names
by equal ones), so that concurrent runs on the shared brokers never meet. What the page leaves
to the reader, the shop's `Order` and billing's `Invoice` models, are stand-ins of this test
that write an Effect row in the caller's transaction.

If the two sides stop fitting together (another exchange, another event type, a routing
pattern that misses it, a handler for a type nobody publishes), the events are dead-lettered or
never arrive, and this test fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox_notify.events import Consumer
from outbox_notify.models import DeadLetter, OutboxMessage
from tests.events_support import dead_letters, remove
from tests.relay_support import ROOT, RelayProcess, wait_for
from tests.testapp.models import Effect

# transaction=True: the relay, the consumer and the publishing shell are other processes; they
# see only committed rows, and the test sees only what they committed.
pytestmark = pytest.mark.django_db(transaction=True)

PAGE = ROOT / "docs" / "events.md"
MARKER = re.compile(r"^<!-- events-example: (\S+) -->\n```python\n(.*?)^```", re.M | re.S)
EXAMPLE_FILES = {"shop/events.py", "shop/orders.py", "billing/events.py"}
DEADLINE = 90.0  # seconds: generous, the machine is shared
SHELL_TIMEOUT = 120  # seconds

STAND_INS = {
    "shop/__init__.py": "",
    "billing/__init__.py": "",
    "shop/models.py": '''
"""Stands in for the shop's Order model (this test's, not the page's): rows are Effects."""
import dataclasses
from decimal import Decimal

from tests.testapp.models import Effect


@dataclasses.dataclass
class Order:
    id: int
    total: Decimal


class _Filtered:
    def __init__(self, order_id):
        self.order_id = order_id

    def update(self, *, cancelled):
        Effect.objects.create(marker=f"order-cancelled:{self.order_id}", task_id="", attempt=0)


class _Orders:
    def create(self, *, customer, total):
        row = Effect.objects.create(marker=f"order:{customer}", task_id="", attempt=0)
        return Order(id=row.id, total=total)

    def filter(self, *, id):
        return _Filtered(id)


Order.objects = _Orders()
''',
    "billing/models.py": '''
"""Stands in for billing's Invoice model (this test's, not the page's): rows are Effects."""
from tests.testapp.models import Effect


class _Filtered:
    def __init__(self, order_id):
        self.order_id = order_id

    def update(self, *, cancelled):
        Effect.objects.create(marker=f"invoice-cancelled:{self.order_id}", task_id="", attempt=0)


class _Invoices:
    def create(self, *, order_id, total):
        Effect.objects.create(marker=f"invoice:{order_id}:{total!r}", task_id="", attempt=0)

    def filter(self, *, order_id):
        return _Filtered(order_id)


class Invoice:
    objects = _Invoices()
''',
}

# Run in the example's environment: declare the page's consumer's queues (as its own process
# does at start; declaring first means no event can precede its binding), then do what the
# page's shop does.
PUBLISH = """
import django
django.setup()
from decimal import Decimal
from billing.events import consumer
from shop.orders import cancel_order, place_order
from tests.events_support import declare
declare({url!r}, consumer)
order = place_order("ann", Decimal("12.50"))
cancel_order(order.id)
print(order.id)
"""


def example_files(tag: str) -> tuple[dict[str, str], dict[str, str]]:
    """The page's example files with their names made unique; and {"x:page name": unique name}."""
    found = {path: code for path, code in MARKER.findall(PAGE.read_text())}
    assert set(found) == EXAMPLE_FILES, sorted(found)
    renamed: dict[str, str] = {}

    def unique(prefix: str, match: re.Match[str]) -> str:
        key = f"{prefix}:{match.group(2)}"
        name = renamed.setdefault(key, f"docs-{prefix}-{tag}-{len(renamed)}")
        return f"{match.group(1)}{name}{match.group(3)}"

    files = {}
    for path, code in found.items():
        renamed_exchanges = re.sub(r'(exchange=")([^"]+)(")', lambda m: unique("x", m), code)
        files[path] = re.sub(
            r'(Consumer\(")([^"]+)(")', lambda m: unique("c", m), renamed_exchanges
        )
    return files, renamed


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The page's example runs on both brokers."""
    fixture = "amqp_url" if request.param == "rabbitmq" else "redis_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def example(
    tmp_path: Path, broker_url: str, subprocess_env: dict[str, Any]
) -> Iterator[tuple[dict[str, Any], Consumer]]:
    """The example's packages on PYTHONPATH; the environment, and the consumer's broker names."""
    files, renamed = example_files(uuid.uuid4().hex[:10])
    root = tmp_path / "example"
    for path, code in {**files, **STAND_INS}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(code)
    env = {
        **subprocess_env,
        "OUTBOX_TEST_BROKER_URL": broker_url,
        "PYTHONPATH": os.pathsep.join([str(root), subprocess_env["PYTHONPATH"]]),
    }
    consumer_name = next(name for name in renamed.values() if name.startswith("docs-c-"))
    exchange = re.search(r'Consumer\("[^"]+", exchange="([^"]+)"', files["billing/events.py"])
    assert exchange, "the page's Consumer(...) names its exchange second, as a keyword"
    consumer = Consumer(consumer_name, exchange=exchange.group(1))
    yield env, consumer
    remove(broker_url, consumer)
    for name in renamed.values():  # the publisher's exchanges, should they differ
        if name.startswith("docs-x-") and name != consumer.exchange:
            remove(broker_url, Consumer(consumer_name, exchange=name))


def _effects(prefix: str) -> list[str]:
    return list(Effect.objects.filter(marker__startswith=prefix).values_list("marker", flat=True))


def test_the_pages_publisher_and_consumer_fit_together(
    example: tuple[dict[str, Any], Consumer], broker_url: str, tmp_path: Path
) -> None:
    """place_order and cancel_order as the page writes them reach the page's handlers, once."""
    env, consumer = example
    relay = RelayProcess("outbox_listen", [], env, tmp_path / "relay.log")
    consuming = RelayProcess(
        "outbox_consume", ["billing.events.consumer"], env, tmp_path / "consume.log"
    )
    try:
        shell = subprocess.run(
            [sys.executable, "-c", PUBLISH.format(url=broker_url)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT,
            check=False,
        )
        assert shell.returncode == 0, shell.stderr
        order_id = int(shell.stdout.split()[-1])
        wait_for(
            lambda: len(_effects("invoice")) == 2,
            timeout=DEADLINE,
            what="the invoice opened and cancelled by the page's handlers",
            context=lambda: relay.output() + consuming.output(),
        )
    finally:
        consuming.stop()
        relay.stop()
    assert sorted(_effects("invoice")) == [
        f"invoice-cancelled:{order_id}",
        f"invoice:{order_id}:Decimal('12.50')",
    ]
    assert sorted(_effects("order")) == [f"order-cancelled:{order_id}", "order:ann"]
    assert OutboxMessage.objects.count() == 0
    assert DeadLetter.objects.count() == 0
    assert dead_letters(broker_url, consumer) == []
