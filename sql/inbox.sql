-- Named queries of the inbox (OnceTask, its purge and its stats), loaded by
-- outbox_notify.inbox through outbox_notify.sql. Each section starts with a `-- name: NAME`
-- line. Parameters use psycopg's %(name)s style.

-- name: record_key
-- Runs first in the task body's transaction. One row inserted: this delivery owns the key and
-- runs the body. No row: the key is committed already (a duplicate). A key inserted by a
-- transaction still open makes this statement wait for it: PostgreSQL then inserts (that
-- transaction rolled back) or does nothing (it committed).
INSERT INTO outbox_notify_inbox_v1 (scope, key, task_id, task_name)
VALUES (%(scope)s, %(key)s, %(task_id)s, %(task_name)s)
ON CONFLICT (scope, key) DO NOTHING;

-- name: record_key_unless_former
-- record_key for a key that replaced the one an earlier release recorded for the same
-- delivery (an event's source and id, which was its id alone): no row either when that
-- former key is committed, so what was handled before an upgrade is still skipped after it.
INSERT INTO outbox_notify_inbox_v1 (scope, key, task_id, task_name)
SELECT %(scope)s, %(key)s, %(task_id)s, %(task_name)s
WHERE NOT EXISTS (
    SELECT FROM outbox_notify_inbox_v1 WHERE scope = %(scope)s AND key = %(former)s
)
ON CONFLICT (scope, key) DO NOTHING;

-- name: key_owner
-- The delivery that committed a key, for the duplicate's log event and signal.
SELECT task_id FROM outbox_notify_inbox_v1 WHERE scope = %(scope)s AND key = %(key)s;

-- name: count_records_upto
SELECT count(*) FROM (SELECT 1 FROM outbox_notify_inbox_v1 LIMIT %(limit)s) AS capped;

-- name: estimate_records
EXPLAIN (FORMAT JSON) SELECT 1 FROM outbox_notify_inbox_v1;

-- name: oldest_record
-- Age of the oldest key (0 when there is none), through the created_at index.
SELECT greatest(extract(epoch FROM clock_timestamp() - min(created_at)), 0)::float8
FROM outbox_notify_inbox_v1;

-- name: inbox_readable
-- Whether the stats can read the inbox: 'ok', 'missing' (before migration 0004_inbox) or
-- 'denied' (a monitoring role granted SELECT before the inbox existed). outbox_stats then
-- reports no inbox figures rather than fail, so probes keep passing across an upgrade.
SELECT CASE
    WHEN to_regclass('outbox_notify_inbox_v1') IS NULL THEN 'missing'
    WHEN NOT has_table_privilege('outbox_notify_inbox_v1', 'SELECT') THEN 'denied'
    ELSE 'ok'
END;

-- name: records_older_than_by_task
-- What a purge would delete, grouped for the dry-run report.
SELECT task_name, count(*) AS count
FROM outbox_notify_inbox_v1
WHERE created_at < %(cutoff)s
GROUP BY task_name
ORDER BY count(*) DESC, task_name;

-- name: purge_records_chunk
-- Deletes at most %(chunk)s keys older than the cut-off, oldest first, through the created_at
-- index. Rows another purge holds are skipped, never waited for.
WITH doomed AS (
    SELECT id FROM outbox_notify_inbox_v1
    WHERE created_at < %(cutoff)s
    ORDER BY created_at
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox_notify_inbox_v1 AS i
USING doomed
WHERE i.id = doomed.id;

-- name: database_now
-- The database's clock, so the purge's cut-off agrees with created_at.
SELECT now();

-- name: inbox_writable
-- What `outbox_consume` checks at start: 'ok', 'missing' (before migration 0004_inbox) or
-- 'denied' (the role cannot both read and insert keys). Without it, every event would fail
-- in its handler's transaction and be retried, then dead-lettered, for a deployment mistake.
SELECT CASE
    WHEN to_regclass('outbox_notify_inbox_v1') IS NULL THEN 'missing'
    WHEN NOT (has_table_privilege('outbox_notify_inbox_v1', 'SELECT')
              AND has_table_privilege('outbox_notify_inbox_v1', 'INSERT')) THEN 'denied'
    ELSE 'ok'
END;
