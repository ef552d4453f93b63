-- Named queries of outbox-notify, loaded by outbox_notify.sql.queries().
-- Each section starts with a `-- name: NAME` line. Parameters use psycopg's %(name)s style.

-- name: insert_message
-- The write side: one row per message, in the caller's transaction. retry_after is NULL,
-- or the ETA of a task held in the outbox until it is due.
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retry_after)
VALUES
    (%(task_id)s, %(task_name)s, %(args)s::json, %(kwargs)s::json, %(options)s::json,
     %(context)s::json, %(schema_version)s, %(retry_after)s);

-- name: copy_messages
-- The bulk write side: many rows in one COPY, in the caller's transaction. COPY fires the
-- statement-level wake-up trigger like an INSERT does.
COPY outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retry_after)
FROM STDIN;

-- name: claim_batch
-- Claims up to %(limit)s due rows for this relay's open transaction. The row locks are the
-- claim: another relay's SKIP LOCKED passes over them, and PostgreSQL releases them the moment
-- this relay commits, rolls back or dies. Rows of a newer schema_version are left for a newer
-- relay. (A plain SELECT ... LIMIT ... FOR UPDATE: the LIMIT sits above the row locking, so
-- the planner cannot lock more rows than it returns.)
--
-- Two scans, one per index, so rows held until a later ETA cost a claim nothing: first the
-- due rows of the "scheduled" index (retries and held rows whose time has come, longest due
-- first), then the ready rows of the "ready now" index in id order. A CTE is read only as far
-- as the outer LIMIT asks, and each locks only what it returns, so the two lock at most
-- %(limit)s rows together. (One scan with `retry_after IS NULL OR retry_after <= now()` walks
-- the primary key and steps over every held row: docs/concepts.md shows both plans.)
-- created_at is, for a held row, its ETA: the relay's lag metric counts from the moment a
-- row became publishable. The last column is that moment's age at the claim, on the
-- database's clock, so the lag never compares the relay host's clock with the server's.
WITH due AS (
    SELECT id, task_id, task_name, args::text, kwargs::text, options::text, context::text,
           retries, schema_version,
           CASE WHEN retries = 0 AND last_error IS NULL
                THEN greatest(created_at, retry_after) ELSE created_at END,
           greatest(extract(epoch FROM now() - CASE WHEN retries = 0 AND last_error IS NULL
                THEN greatest(created_at, retry_after) ELSE created_at END), 0)::float8
    FROM outbox_notify_message_v1
    WHERE retry_after <= now()
      AND schema_version <= %(max_version)s
    ORDER BY retry_after
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
ready AS (
    SELECT id, task_id, task_name, args::text, kwargs::text, options::text, context::text,
           retries, schema_version, created_at,
           greatest(extract(epoch FROM now() - created_at), 0)::float8 AS age
    FROM outbox_notify_message_v1
    WHERE retry_after IS NULL
      AND schema_version <= %(max_version)s
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
SELECT * FROM due
UNION ALL
SELECT * FROM ready
LIMIT %(limit)s;

-- name: delete_published
-- The common end of a batch: every message went out.
DELETE FROM outbox_notify_message_v1 WHERE id = ANY(%(ids)s::bigint[]);

-- name: finalize_batch
-- The end of a batch with failures, in one round trip: delete what was published, reschedule
-- what failed (spending a retry or not), move what is beyond saving to the dead letters.
WITH published AS (
    DELETE FROM outbox_notify_message_v1 WHERE id = ANY(%(published)s::bigint[])
),
rescheduled AS (
    UPDATE outbox_notify_message_v1 AS m
    SET retries = f.retries,
        retry_after = now() + make_interval(secs => f.delay),
        last_error = f.error
    FROM unnest(%(retry_ids)s::bigint[], %(retry_counts)s::integer[],
                %(retry_delays)s::float8[], %(retry_errors)s::text[])
         AS f(id, retries, delay, error)
    WHERE m.id = f.id
),
dead AS (
    DELETE FROM outbox_notify_message_v1 AS m
    USING unnest(%(dead_ids)s::bigint[], %(dead_counts)s::integer[], %(dead_reasons)s::text[])
          AS d(id, retries, reason)
    WHERE m.id = d.id
    RETURNING m.task_id, m.task_name, m.args, m.kwargs, m.options, m.context,
              m.schema_version, d.retries, d.reason, m.created_at
)
INSERT INTO outbox_notify_dead_letter_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retries,
     failure_reason, created_at)
SELECT task_id, task_name, args, kwargs, options, context, schema_version, retries,
       reason, created_at
FROM dead;

-- name: peek
-- Before sleeping: is there a row this relay could claim now, is there a due row another
-- relay holds, and in how many seconds does the next retry or held row fall due? Each test
-- reads one index ("ready now" or "scheduled") from its end, so held rows cost nothing here.
WITH due AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after <= now()
      AND schema_version <= %(max_version)s
    ORDER BY retry_after
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
ready AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after IS NULL
      AND schema_version <= %(max_version)s
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
SELECT
    EXISTS (SELECT 1 FROM due) OR EXISTS (SELECT 1 FROM ready) AS claimable,
    EXISTS (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE retry_after <= now() AND schema_version <= %(max_version)s
    ) OR EXISTS (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE retry_after IS NULL AND schema_version <= %(max_version)s
    ) AS due,
    (SELECT extract(epoch FROM min(retry_after) - now())::float8
     FROM outbox_notify_message_v1 WHERE retry_after > now()) AS next_due_in;

-- name: set_claim_timeout
-- Bounds a hung relay: if it sits idle inside its claim for this long, the server ends its
-- session and the rows are free again. Transaction-local, so it is safe behind a pooler.
-- The planner settings, also transaction-local, make the claim read its two indexes in order
-- whatever the table's statistics say (and the finalising statements find rows by primary
-- key, which they do anyway). An outbox table is analysed while it is nearly empty, or not
-- yet at all (a new install, a burst): the planner then guesses a few hundred ready rows,
-- and a claim of more rows than it guesses became a scan of the whole table and an on-disk
-- sort of every row, at every claim, until autovacuum analysed the table again (270 ms for a
-- batch of 2,000 out of 100,000 fresh rows, against 11 ms by the index).
SELECT set_config('idle_in_transaction_session_timeout', %(timeout_ms)s, true),
       set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true),
       set_config('enable_sort', 'off', true);

-- name: set_claim_lock_wait
-- A claim made while this relay already holds another one must not queue behind a lock
-- request that waits for that other claim (a TRUNCATE, an ALTER TABLE, a migration): the
-- relay would wait for itself. Transaction-local, and only for the claim itself.
SELECT set_config('lock_timeout', %(wait)s, true);

-- name: reset_claim_lock_wait
-- After the claim: the finalising statements wait for locks as the session does.
SET LOCAL lock_timeout TO DEFAULT;

-- name: listen
LISTEN outbox_notify_v1;

-- name: listen_probe
LISTEN outbox_notify_v1_probe;

-- name: unlisten_probe
UNLISTEN outbox_notify_v1_probe;

-- name: notify_probe
SELECT pg_notify('outbox_notify_v1_probe', %(payload)s);

-- name: set_lock_timeout
SELECT set_config('lock_timeout', %(timeout_ms)s, false);

-- name: take_wake_lock
-- The relay is about to sleep: from now on writers notify (see sql/install.sql).
SELECT pg_advisory_lock(1869968482, 1);

-- name: release_wake_lock
SELECT pg_advisory_unlock(1869968482, 1);

-- name: take_wake_lock_bounded
-- PostgreSQL 14+: while it holds the lock, a relay that stops responding (frozen, hung)
-- loses its session after %(timeout_ms)s of silence, so the lock cannot outlive it. A healthy
-- sleeping relay speaks on this connection at least once per sweep interval.
SELECT set_config('idle_session_timeout', %(timeout_ms)s, false), pg_advisory_lock(1869968482, 1);

-- name: release_wake_lock_bounded
SELECT pg_advisory_unlock(1869968482, 1), set_config('idle_session_timeout', '0', false);

-- name: await_wake_lock
-- While writers' open transactions hold the wake lock (a writer inserted while every relay
-- was draining, and keeps its transaction open): if a row is claimable now, say so and do not
-- queue; otherwise queue for the lock for at most the session's lock_timeout. The writers'
-- commit hands the lock over at once, so their rows are found without delay; a lock timeout
-- (an error) means they still hold it. The CASE evaluates the lock only when nothing is
-- claimable (tested as the peek does, one index each). One statement per lock_timeout is
-- all a relay spends waiting for writers.
WITH due AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after <= now()
      AND schema_version <= %(max_version)s
    ORDER BY retry_after
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
ready AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after IS NULL
      AND schema_version <= %(max_version)s
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
found AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM due) OR EXISTS (SELECT 1 FROM ready) AS claimable
)
SELECT claimable,
       CASE WHEN claimable THEN false
            ELSE (SELECT true FROM pg_advisory_lock(1869968482, 1))
       END AS locked
FROM found;

-- name: await_wake_lock_bounded
-- await_wake_lock on PostgreSQL 14+, setting idle_session_timeout with the lock as
-- take_wake_lock_bounded does (set_config is undone with the statement on a lock timeout).
WITH due AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after <= now()
      AND schema_version <= %(max_version)s
    ORDER BY retry_after
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
ready AS (
    SELECT id FROM outbox_notify_message_v1
    WHERE retry_after IS NULL
      AND schema_version <= %(max_version)s
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
found AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM due) OR EXISTS (SELECT 1 FROM ready) AS claimable
)
SELECT claimable,
       CASE WHEN claimable THEN false
            ELSE (SELECT true FROM pg_advisory_lock(1869968482, 1)
                  WHERE set_config('idle_session_timeout', %(timeout_ms)s, false) IS NOT NULL)
       END AS locked
FROM found;

-- name: queue_gauges
-- The relay's queue gauges, from the outbox table alone (the relay role may read nothing
-- else): the depth, exact up to %(limit)s rows and beyond that the planner's way of
-- estimating it (rows per page at the last ANALYZE times the table's pages now), and the
-- oldest pending row's age on the database's clock, defined as ops.sql's oldest_pending
-- defines it for outbox_stats (a row held until its ETA is pending from its ETA on; up to
-- %(window)s scheduled rows are read). Keep the two in step.
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM outbox_notify_message_v1 LIMIT %(limit)s) AS capped)
        AS counted,
    (SELECT CASE WHEN c.relpages > 0 AND c.reltuples > 0
                 THEN (c.reltuples / c.relpages
                       * (pg_relation_size(c.oid) / current_setting('block_size')::float8))
            END
     FROM pg_class AS c
     WHERE c.oid = 'outbox_notify_message_v1'::regclass)::float8 AS estimated,
    greatest(
        (SELECT extract(epoch FROM clock_timestamp() - created_at)
         FROM outbox_notify_message_v1
         WHERE retry_after IS NULL
         ORDER BY id
         LIMIT 1),
        (SELECT extract(epoch FROM clock_timestamp() - min(
                    CASE WHEN retries > 0 OR last_error IS NOT NULL THEN created_at
                         WHEN retry_after <= now() THEN greatest(created_at, retry_after)
                    END))
         FROM (SELECT created_at, retry_after, retries, last_error
               FROM outbox_notify_message_v1
               WHERE retry_after IS NOT NULL
               ORDER BY retry_after
               LIMIT %(window)s) AS scheduled),
        0)::float8 AS oldest_seconds;

-- name: wake_lock_holder
-- Who holds the wake lock this relay could not get: another sleeping relay (exclusive) or
-- writers whose transactions are still open (shared)?
SELECT coalesce(bool_or(mode = 'ExclusiveLock'), false) AS relay_sleeping
FROM pg_locks
WHERE locktype = 'advisory' AND classid = 1869968482 AND objid = 1 AND objsubid = 2
  AND granted
  -- Advisory locks belong to one database: a relay of another database on the same cluster
  -- is not a peer.
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
