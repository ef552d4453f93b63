-- Named queries about tasks held in the outbox until their ETA (outbox_notify.held): the
-- figures outbox_stats and the admin show, and cancelling (AsyncResult.revoke(), the admin).
-- Each section starts with a `-- name: NAME` line. Parameters use psycopg's %(name)s style.
--
-- A held row is one never tried whose retry_after (its ETA) is set: retries = 0 and
-- last_error IS NULL (sql/install.sql). Every query reads the "scheduled" index
-- (retry_after) or the task_id index, never the whole table.

-- name: _cancel_doomed
-- The end of both cancels: delete the rows of `doomed`, say which were held and whether their
-- task ignores its result.
DELETE FROM outbox_notify_message_v1 AS m
USING doomed
WHERE m.id = doomed.id
RETURNING m.id, m.task_id, m.task_name,
          coalesce(m.retry_after > now() AND m.retries = 0 AND m.last_error IS NULL, false)
              AS held,
          coalesce(m.options -> 'headers' ->> 'ignore_result', 'false') = 'true'
              AS ignore_result

-- name: count_held_upto
-- Held rows whose ETA is still ahead; stops reading after %(limit)s rows.
SELECT count(*) FROM (
    SELECT 1 FROM outbox_notify_message_v1
    WHERE
    -- include: _held
    LIMIT %(limit)s
) AS capped;

-- name: estimate_held
EXPLAIN (FORMAT JSON)
SELECT 1 FROM outbox_notify_message_v1
WHERE
-- include: _held
;

-- name: next_held
-- The next held row to fall due: when, and in how many seconds on the database's clock.
SELECT retry_after, extract(epoch FROM retry_after - now())::float8
FROM outbox_notify_message_v1
WHERE
-- include: _held
ORDER BY retry_after
LIMIT 1;

-- name: cancel_by_task_ids
-- Removes the outbox rows of these Celery task ids that no relay holds (a held row is
-- publishing right now: SKIP LOCKED passes over it instead of waiting). Found through the
-- task_id index.
WITH doomed AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE task_id = ANY(%(task_ids)s::text[])
    FOR UPDATE SKIP LOCKED
)
-- include: _cancel_doomed
;

-- name: cancel_by_ids
-- The same, for outbox rows chosen by id (the admin action).
WITH doomed AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE id = ANY(%(ids)s::bigint[])
    FOR UPDATE SKIP LOCKED
)
-- include: _cancel_doomed
;
