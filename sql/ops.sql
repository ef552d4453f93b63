-- Named queries of the operator tools (stats, dead-letter purge and requeue, admin actions),
-- loaded by outbox_notify.stats / deadletter / admin through outbox_notify.sql.
-- Each section starts with a `-- name: NAME` line. Parameters use psycopg's %(name)s style.
--
-- Every query here must stay cheap on tables of millions of rows: exact counts only where an
-- index or a LIMIT bounds the work, planner estimates otherwise.

-- name: plan_like_the_relay
-- Read the indexes in order whatever the table's statistics say, as the relay's claims do
-- (sql/queries.sql, set_claim_timeout), without JIT compiling: for this transaction only.
SELECT set_config('jit', 'off', true),
       set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true),
       set_config('enable_sort', 'off', true);

-- name: count_messages_upto
-- Exact queue depth when it is small: the rows `pending` holds (see sql/fragments.sql), read
-- from the newest frontier a relay saved, each forward read stopping after %(limit)s rows.
-- Rows published and deleted, which an old snapshot keeps in the table, cost nothing.
WITH
-- include: _pending
SELECT count(*) FROM pending;

-- name: estimate_messages
-- The planner's row estimate for the whole outbox (pg_class.reltuples scaled to the table's
-- current size; works before the first ANALYZE too).
EXPLAIN (FORMAT JSON) SELECT 1 FROM outbox_notify_message_v1;

-- name: count_retrying_upto
-- Rows waiting for a retry that is not due yet: rows that failed (a retry or a broker outage
-- sets last_error) read through the failed index, so held rows cost nothing. A row never
-- tried (retries = 0, no last_error) is held until its ETA, not retrying: see sql/held.sql.
SELECT count(*) FROM (
    SELECT 1 FROM outbox_notify_message_v1
    WHERE
    -- include: _retrying
    LIMIT %(limit)s
) AS capped;

-- name: estimate_retrying
EXPLAIN (FORMAT JSON)
SELECT 1 FROM outbox_notify_message_v1
WHERE
-- include: _retrying
;

-- name: count_dead_letters_upto
SELECT count(*) FROM (SELECT 1 FROM outbox_notify_dead_letter_v1 LIMIT %(limit)s) AS capped;

-- name: estimate_dead_letters
EXPLAIN (FORMAT JSON) SELECT 1 FROM outbox_notify_dead_letter_v1;

-- name: oldest_pending
-- Age of the oldest pending row (see _oldest_pending in sql/fragments.sql; the relay's
-- queue_gauges reports the same), read from the newest frontier a relay saved.
WITH
-- include: _pending
SELECT
    -- include: _oldest_pending
    ;

-- name: top_failing
-- Task names with the most retries, over bounded windows: up to %(window)s failing outbox
-- rows (found through the failed index: a held row never failed, so costs nothing here)
-- and the %(window)s most recent dead letters (through the dead_at index). `full_window`
-- tells the caller whether a window was cut short, i.e. whether the figures are a sample.
WITH failing AS (
    SELECT task_name, retries
    FROM outbox_notify_message_v1
    WHERE retries > 0
    LIMIT %(window)s
),
dead AS (
    SELECT task_name, retries
    FROM outbox_notify_dead_letter_v1
    ORDER BY dead_at DESC
    LIMIT %(window)s
),
per_task AS (
    SELECT task_name, count(*) AS failing, 0 AS dead_letters, sum(retries) AS retries
    FROM failing GROUP BY task_name
    UNION ALL
    SELECT task_name, 0, count(*), sum(retries)
    FROM dead GROUP BY task_name
)
SELECT task_name,
       sum(failing)::bigint AS failing,
       sum(dead_letters)::bigint AS dead_letters,
       sum(retries)::bigint AS retries,
       (SELECT count(*) FROM failing) >= %(window)s
           OR (SELECT count(*) FROM dead) >= %(window)s AS full_window
FROM per_task
GROUP BY task_name
ORDER BY sum(retries) DESC, sum(dead_letters) DESC, task_name
LIMIT %(top)s;

-- name: events_by_type
-- Domain events (schema_version %(version)s) by type, over bounded windows like top_failing:
-- among the pending rows (`pending`, read from the newest frontier a relay saved, up to
-- %(limit)s rows per read) and the %(window)s most recent dead letters. `full_window` tells
-- whether a window was cut short (a sample).
WITH
-- include: _pending
,
oldest AS (
    SELECT task_name, schema_version FROM pending
),
dead AS (
    SELECT task_name, schema_version
    FROM outbox_notify_dead_letter_v1
    ORDER BY dead_at DESC
    LIMIT %(window)s
),
per_type AS (
    SELECT task_name, count(*) AS pending, 0 AS dead_letters
    FROM oldest WHERE schema_version = %(version)s GROUP BY task_name
    UNION ALL
    SELECT task_name, 0, count(*)
    FROM dead WHERE schema_version = %(version)s GROUP BY task_name
)
SELECT task_name,
       sum(pending)::bigint AS pending,
       sum(dead_letters)::bigint AS dead_letters,
       (SELECT count(*) FROM oldest) >= %(limit)s
           OR (SELECT count(*) FROM dead) >= %(window)s AS full_window
FROM per_type
GROUP BY task_name
ORDER BY sum(pending) + sum(dead_letters) DESC, task_name
LIMIT %(top)s;

-- name: vacuum_horizon
-- The outbox's dead rows, how many of them a snapshot holds back, and the oldest snapshot that
-- keeps vacuum from removing them (see _dead_rows, _dead_rows_held and _snapshot_holder in
-- sql/fragments.sql).
WITH
-- include: _snapshot_holder
SELECT
    -- include: _dead_rows
        AS dead_rows,
    -- include: _dead_rows_held
        AS dead_rows_held,
    h.kind, h.xids, h.seconds, h.pid, h.name
FROM (SELECT 1) AS one
LEFT JOIN holder AS h ON true;

-- name: notify_queue_usage
-- Fraction (0..1) of the server's NOTIFY queue in use; near 1, notifying commits fail.
SELECT pg_notification_queue_usage()::float8;

-- name: relay_sessions
-- Relays seen in pg_stat_activity by the application_name their connections set. A claim
-- connection with an open transaction (xact_start set) is publishing a claimed batch.
-- Sessions of other roles show xact_start only to superusers and pg_read_all_stats members.
SELECT
    count(*) FILTER (WHERE application_name = 'outbox_notify.listen') AS listening,
    count(*) FILTER (
        WHERE application_name = 'outbox_notify.claim' AND xact_start IS NOT NULL
    ) AS claims_open,
    coalesce(
        max(greatest(extract(epoch FROM clock_timestamp() - xact_start), 0)) FILTER (
            WHERE application_name = 'outbox_notify.claim'
        ),
        0
    )::float8 AS oldest_claim_seconds
FROM pg_stat_activity
WHERE datname = current_database()
  AND application_name IN ('outbox_notify.listen', 'outbox_notify.claim');

-- name: database_now
-- The database's clock, so every cut-off and re-based time agrees with created_at/dead_at.
SELECT now();

-- name: dead_letters_older_than_by_task
-- What a purge would delete, grouped for the dry-run report.
SELECT task_name, count(*) AS count
FROM outbox_notify_dead_letter_v1
WHERE dead_at < %(cutoff)s
GROUP BY task_name
ORDER BY count(*) DESC, task_name;

-- name: purge_dead_letters_chunk
-- Deletes at most %(chunk)s dead letters older than the cut-off, oldest first, through the
-- dead_at index. Rows a concurrent requeue holds are skipped, never waited for.
WITH doomed AS (
    SELECT id FROM outbox_notify_dead_letter_v1
    WHERE dead_at < %(cutoff)s
    ORDER BY dead_at
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox_notify_dead_letter_v1 AS d
USING doomed
WHERE d.id = doomed.id;

-- name: dead_letters_by_ids
-- The next chunk of a requeue (or of its dry run, so both see the same rows), selected by id,
-- in id order after %(after)s. Rows another requeue or purge holds are skipped.
SELECT id, task_name, options::text
FROM outbox_notify_dead_letter_v1
WHERE id = ANY(%(ids)s::bigint[]) AND id > %(after)s
ORDER BY id
LIMIT %(chunk)s
FOR UPDATE SKIP LOCKED;

-- name: dead_letters_by_task_name
SELECT id, task_name, options::text
FROM outbox_notify_dead_letter_v1
WHERE task_name = %(task_name)s AND id > %(after)s
ORDER BY id
LIMIT %(chunk)s
FOR UPDATE SKIP LOCKED;

-- name: dead_letters_all
SELECT id, task_name, options::text
FROM outbox_notify_dead_letter_v1
WHERE id > %(after)s
ORDER BY id
LIMIT %(chunk)s
FOR UPDATE SKIP LOCKED;

-- name: requeue_dead_letters_chunk
-- Moves one chunk back to the outbox in one statement: delete the dead letters and insert
-- them as fresh outbox rows (retries 0, never tried, created now) with the re-based options
-- the caller computed. The insert fires the wake-up trigger, so a sleeping relay wakes.
WITH moved AS (
    DELETE FROM outbox_notify_dead_letter_v1 AS d
    USING unnest(%(ids)s::bigint[], %(options)s::text[]) AS n(id, options)
    WHERE d.id = n.id
    RETURNING d.id, d.task_id, d.task_name, d.args, d.kwargs, n.options, d.context,
              d.schema_version
)
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, context, schema_version, retries,
     retry_after, last_error, created_at)
SELECT task_id, task_name, args, kwargs, options::json, context, schema_version, 0,
       NULL, NULL, now()
FROM moved
ORDER BY id;

-- name: reset_retries
-- Admin action: make failed rows due now with a fresh retry budget. Rows a relay holds in an
-- open claim are skipped (SKIP LOCKED), never waited for or overwritten; the caller counts
-- them from what is returned. A row held until its ETA (never tried) is left alone: resetting
-- it would publish it early.
UPDATE outbox_notify_message_v1
SET retries = 0, retry_after = NULL
WHERE id = ANY(%(ids)s::bigint[])
  AND (retry_after IS NULL OR retries > 0 OR last_error IS NOT NULL)
  AND id IN (
      SELECT id FROM outbox_notify_message_v1
      WHERE id = ANY(%(ids)s::bigint[])
      FOR UPDATE SKIP LOCKED
  )
RETURNING id;

-- name: wake_relays
-- Rows made due by an update (not an insert) fire no trigger: tell sleeping relays.
SELECT pg_notify('outbox_notify_v1', '');

-- name: list_pending_page
-- outbox_list --state pending: outbox rows not held for an ETA (ready now, or waiting for a
-- retry), oldest first, one page after id %(after)s, through the primary key. Each filter is
-- off when its parameter is NULL. Filters narrow what matches, not what is read: a page reads
-- rows in id order until it has %(page)s matches (see docs/reference.md, outbox_list).
SELECT id, task_id, task_name, schema_version, args::text, kwargs::text, retries,
       retry_after, last_error, created_at
FROM outbox_notify_message_v1
WHERE id > %(after)s
  AND (retry_after IS NULL OR retries > 0 OR last_error IS NOT NULL)
  AND (%(task_name)s::text IS NULL OR task_name = %(task_name)s::text)
  AND (%(cutoff)s::timestamptz IS NULL OR created_at < %(cutoff)s::timestamptz)
  AND (%(error)s::text IS NULL OR strpos(lower(last_error), lower(%(error)s::text)) > 0)
ORDER BY id
LIMIT %(page)s;

-- name: list_held_page
-- outbox_list --state held: rows held until their ETA (never tried), the soonest due first,
-- one page after (%(after_at)s, %(after)s), through the partial retry_after index. A held row
-- has no error, so an error filter matches none.
SELECT id, task_id, task_name, schema_version, args::text, kwargs::text, retries,
       retry_after, last_error, created_at
FROM outbox_notify_message_v1
WHERE retry_after IS NOT NULL AND retries = 0 AND last_error IS NULL
  AND (retry_after, id) > (%(after_at)s::timestamptz, %(after)s)
  AND (%(task_name)s::text IS NULL OR task_name = %(task_name)s::text)
  AND (%(cutoff)s::timestamptz IS NULL OR created_at < %(cutoff)s::timestamptz)
  AND (%(error)s::text IS NULL OR strpos(lower(last_error), lower(%(error)s::text)) > 0)
ORDER BY retry_after, id
LIMIT %(page)s;

-- name: list_dead_page
-- outbox_list --state dead: dead letters, oldest first, one page after id %(after)s, through
-- the primary key (with --task-name, the planner may take the task_name index instead). The
-- age is the time since the row died (dead_at); the error is failure_reason.
SELECT id, task_id, task_name, schema_version, args::text, kwargs::text, retries,
       dead_at, failure_reason, created_at
FROM outbox_notify_dead_letter_v1
WHERE id > %(after)s
  AND (%(task_name)s::text IS NULL OR task_name = %(task_name)s::text)
  AND (%(cutoff)s::timestamptz IS NULL OR dead_at < %(cutoff)s::timestamptz)
  AND (%(error)s::text IS NULL OR strpos(lower(failure_reason), lower(%(error)s::text)) > 0)
ORDER BY id
LIMIT %(page)s;

-- name: outbox_indexes
-- The outbox table's indexes with their size, for outbox_reindex. `leftover` marks an invalid
-- index that an interrupted REINDEX INDEX CONCURRENTLY left behind (named ..._ccnew or
-- ..._ccold): it costs every write and is dropped before anything is rebuilt.
SELECT n.nspname AS schema, c.relname AS name, pg_relation_size(c.oid) AS bytes,
       NOT i.indisvalid AND c.relname ~ '_cc(new|old)[0-9]*$' AS leftover,
       pg_has_role(t.relowner, 'USAGE') AS owned
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
JOIN pg_class AS t ON t.oid = i.indrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE i.indrelid = 'outbox_notify_message_v1'::regclass
ORDER BY c.relname;

-- name: outbox_table_bytes
-- The outbox table's own size (its heap), which the relay compares its indexes with.
SELECT pg_relation_size('outbox_notify_message_v1'::regclass);

-- name: try_reindex_lock
-- One relay's index keeper rebuilds at a time (outbox_notify/index_keeper.py): a session
-- advisory lock, on the key of the relay's wake lock with a second number of its own.
SELECT pg_try_advisory_lock(1869968482, 2);

-- name: keeper_session
-- The index keeper's own short session (outbox_notify/index_keeper.py): no statement timeout.
SELECT set_config('statement_timeout', '0', false);

-- name: reindex_unlock
SELECT pg_advisory_unlock(1869968482, 2);

-- name: reindex_index
-- The placeholder is the index, as psycopg.sql.Identifier(schema, name). CONCURRENTLY: writers and the
-- relay's claims go on while the index is rebuilt (it cannot run inside a transaction).
REINDEX INDEX CONCURRENTLY {};

-- name: drop_index
-- The placeholder is the index, as psycopg.sql.Identifier(schema, name); only for the
-- leftovers of an interrupted rebuild (see outbox_indexes).
DROP INDEX CONCURRENTLY IF EXISTS {};

-- name: set_reindex_lock_timeout
-- How long a rebuild may wait for the transactions running when it began (milliseconds).
SELECT set_config('lock_timeout', %(timeout_ms)s, false);

-- name: reset_lock_timeout
RESET lock_timeout;

-- name: dashboard_series
-- The admin dashboard's charts (outbox_notify/dashboard.py): the relays' samples of the last
-- %(window)s seconds in buckets of %(bucket)s seconds, read through the sample table's
-- `at` index. The queue's gauges are the same for every relay: the highest per bucket. The
-- counts add up over relays; the rate is the bucket's published rows per second. Lag: the
-- relays' p50s averaged, the highest p99.
SELECT
    floor(extract(epoch FROM at) / %(bucket)s) * %(bucket)s AS t,
    max(depth) AS depth,
    max(held) AS held,
    max(retrying) AS retrying,
    max(dead_letters) AS dead_letters,
    sum(published) / %(bucket)s::float8 AS rate,
    sum(retried) AS retried,
    avg(lag_p50_ms) AS lag_p50_ms,
    max(lag_p99_ms) AS lag_p99_ms
FROM outbox_notify_sample_v1
WHERE at > now() - make_interval(secs => %(window)s)
GROUP BY 1
ORDER BY 1;

-- name: dashboard_dead_by_task
-- Rows dead-lettered per task and bucket over the last %(window)s seconds.
SELECT floor(extract(epoch FROM s.at) / %(bucket)s) * %(bucket)s AS t, d.key,
       sum(d.value::bigint) AS dead
FROM outbox_notify_sample_v1 AS s, json_each_text(s.dead_by_task) AS d
WHERE s.at > now() - make_interval(secs => %(window)s)
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: dashboard_relays
-- Each relay's last sample of the last %(window)s seconds: who it is, how it waits, when it
-- last wrote (its heartbeat) and its publish rate over that row's interval.
SELECT DISTINCT ON (relay) relay, host, pid, mode, at,
       published / greatest(seconds, 1e-9) AS rate, lag_p99_ms
FROM outbox_notify_sample_v1
WHERE at > now() - make_interval(secs => %(window)s)
ORDER BY relay, at DESC;

-- name: dashboard_next_held
-- The next %(limit)s held rows (never tried, ETA ahead), the soonest first, through the
-- scheduled index from now on.
SELECT id, task_name, retry_after
FROM outbox_notify_message_v1
WHERE retry_after > now() AND retries = 0 AND last_error IS NULL
ORDER BY retry_after, id
LIMIT %(limit)s;
