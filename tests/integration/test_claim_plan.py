"""The claim reads its two indexes in order whatever the table's statistics say.

An outbox table is mostly empty, so autovacuum analyses it while it is empty (or has not yet:
a new install). When a burst then arrives, the planner guesses a few hundred ready rows, and
a claim of more rows than it guesses used to become a scan of the whole table and a sort of
every row, at every claim until the next analyse: 270 ms per claim of 2,000 out of 100,000
fresh rows instead of 11 ms (RabbitMQ drain, `python -m devtools.amqp_drain --backlog 100000
--batch-size 2000`: 6,400-7,200 msg/s before, 13,200-13,900 after).

The plan is read from the claim connection itself with auto_explain, which reports every
statement's plan to the client as a NOTICE: so this is the claim as the relay runs it.
"""

from __future__ import annotations

import pytest
from django.db import connection

from outbox_notify.relay import runner
from outbox_notify.relay.store import ClaimStore

ROWS = 5_000
BATCH = 2_000


def _burst_after_an_empty_analyse(retrying: int) -> None:
    with connection.cursor() as cur:
        cur.execute("ANALYZE outbox_notify_message_v1")  # while it is empty
        cur.execute(
            "INSERT INTO outbox_notify_message_v1"
            " (task_id, task_name, args, kwargs, options, schema_version, retry_after)"
            " SELECT gen_random_uuid()::text, 'tests.add', '[1, 2]', '{}', '{}', 1,"
            "        CASE WHEN n <= %s THEN now() - interval '1 minute' END"
            " FROM generate_series(1, %s) AS n",
            [retrying, ROWS],
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("retrying", [0, 3_000], ids=["ready rows", "due retries"])
def test_a_claim_after_a_burst_on_an_empty_analysed_table_reads_only_its_indexes(
    retrying: int,
) -> None:
    _burst_after_an_empty_analyse(retrying)
    store = ClaimStore(runner.connection_kwargs("default"), stale_timeout=30)
    store.connect()
    assert store.conn is not None
    plans: list[str] = []
    store.conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
    try:
        with store.conn.transaction():
            store.conn.execute("LOAD 'auto_explain'")
        store.conn.execute("SET auto_explain.log_min_duration = 0")
        store.conn.execute("SET auto_explain.log_level = 'notice'")
        store.conn.commit()
        plans.clear()
        with store.claim(BATCH) as claim:
            assert len(claim.rows) == BATCH
        claim_plans = [p for p in plans if "outbox_notify_message_v1_ready_txid_idx" in p]
        assert len(claim_plans) == 1, plans
        plan = claim_plans[0]
        assert "Index Scan using outbox_notify_message_v1_ready_txid_idx" in plan, plan
        assert "Index Scan using outbox_notify_message_v1_scheduled_idx" in plan, plan
        for node in ("Seq Scan", "Bitmap", "Sort"):
            assert node not in plan, plan
    finally:
        store.close()
