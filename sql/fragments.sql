-- Fragments of the named queries, each written once and included where a query of
-- sql/queries.sql, ops.sql, ... has a line `-- include: _NAME` (outbox_notify/sql.py replaces
-- the line with the fragment's text when it loads the file). A fragment's name starts with
-- `_`. Parameters use psycopg's %(name)s style; those of the relay's frontier come from
-- outbox_notify.relay.frontier.Frontier.params().

-- name: _recheck_rows
-- A condition on `m`, an outbox row (the claim predicates below are each written here once,
-- for claim_batch, _claimable and peek): a row the frontier rechecks by id, ready or due now,
-- of a schema version this relay reads.
m.id = ANY(%(recheck)s::bigint[])
      -- On no Vars: a one-time filter, so with no rows to recheck the index is not opened.
      AND cardinality(%(recheck)s::bigint[]) > 0
      AND (m.retry_after IS NULL OR m.retry_after <= statement_timestamp())
      AND m.schema_version <= %(max_version)s

-- name: _late_ready_rows
-- A condition on `m`: a ready row of a transaction in progress at an earlier claim.
m.txid = ANY(%(late)s::xid8[]) AND cardinality(%(late)s::xid8[]) > 0
      AND m.retry_after IS NULL
      AND m.schema_version <= %(max_version)s

-- name: _late_due_rows
-- A condition on `m`: a due row of a transaction in progress at an earlier claim.
m.txid = ANY(%(late)s::xid8[]) AND cardinality(%(late)s::xid8[]) > 0
      AND m.retry_after <= statement_timestamp()
      AND m.schema_version <= %(max_version)s

-- name: _due_rows
-- A condition on `m`: a scheduled row fallen due after the due position.
m.retry_after <= statement_timestamp()
      AND (m.retry_after, m.id) > (%(due_at)s::timestamptz, %(due_id)s::bigint)
      AND m.schema_version <= %(max_version)s

-- name: _walked_rows
-- A condition on `w`, an outbox row: a scheduled row written after the scheduled position.
w.retry_after IS NOT NULL
      AND (w.txid, w.id) > (%(sched_txid)s::xid8, %(sched_id)s::bigint)

-- name: _fresh_lookup
-- A WHERE clause on `m`: the rows of `walked` (a CTE of scheduled rows written since the
-- scheduled position) that are due now, looked up by id through the primary key and through
-- nothing else, whatever the statistics. As `m.id IN (SELECT id FROM walked)`, a generic plan
-- could read a whole partial index (every scheduled row, and every dead one an old snapshot
-- kept) and join it to `walked`; `coalesce` keeps the partial indexes out of the plan, as the
-- planner cannot prove their `retry_after IS NOT NULL` from it (a row with no retry_after is
-- not due either way).
WHERE m.id = ANY(ARRAY(SELECT w.id FROM walked AS w
                       WHERE w.retry_after <= statement_timestamp()
                         AND w.schema_version <= %(max_version)s))
      AND coalesce(m.retry_after, 'infinity'::timestamptz) <= statement_timestamp()
      AND m.schema_version <= %(max_version)s

-- name: _ready_rows
-- A condition on `m`: a ready row (no retry_after) after the ready position.
m.retry_after IS NULL
      AND (m.txid, m.id) > (%(ready_txid)s::xid8, %(ready_id)s::bigint)
      AND m.schema_version <= %(max_version)s

-- name: _claimable
-- CTEs that each lock at most one row this session could claim now, read from the relay's
-- frontier exactly as claim_batch reads its five parts, and `found`, whether any of them has
-- one. The queries that include it run in autocommit: the row locks go with the statement.
rechecked AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _recheck_rows
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
late_ready AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _late_ready_rows
    ORDER BY m.txid, m.id  -- pins the read to its index (see claim_batch's ready_left)
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
late_due AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _late_due_rows
    ORDER BY m.txid, m.id  -- pins the read to its index (see claim_batch's ready_left)
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
due AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _due_rows
    ORDER BY m.retry_after, m.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
walked AS MATERIALIZED (
    SELECT w.id, w.retry_after, w.schema_version FROM outbox_notify_message_v1 AS w
    WHERE
    -- include: _walked_rows
    ORDER BY w.txid, w.id
    LIMIT %(walk)s
),
fresh AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    -- include: _fresh_lookup
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
ready AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _ready_rows
    ORDER BY m.txid, m.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
found AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM rechecked) OR EXISTS (SELECT 1 FROM late_ready)
        OR EXISTS (SELECT 1 FROM late_due) OR EXISTS (SELECT 1 FROM due)
        OR EXISTS (SELECT 1 FROM fresh) OR EXISTS (SELECT 1 FROM ready) AS claimable
)

-- name: _pending
-- A CTE `pending`: the outbox's live rows as a relay's frontier sees them, the way claims
-- read the table: ready rows past the ready position (in claim order), scheduled rows past
-- the due position (by the time they fall due) or written since the scheduled position, and
-- the rows the frontier rechecks by id or whose transactions it looks up by txid. Each forward read stops after %(limit)s rows. No
-- read starts at the beginning of an index, so rows published and deleted (kept in place by
-- an old snapshot) cost nothing here.
pending AS MATERIALIZED (
    (SELECT m.id, m.task_name, m.schema_version, m.created_at, m.retry_after, m.retries,
            m.last_error
     FROM outbox_notify_message_v1 AS m
     WHERE m.retry_after IS NULL
       AND (m.txid, m.id) > (%(ready_txid)s::xid8, %(ready_id)s::bigint)
     ORDER BY m.txid, m.id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id, m.task_name, m.schema_version, m.created_at, m.retry_after, m.retries,
            m.last_error
     FROM outbox_notify_message_v1 AS m
     WHERE m.retry_after IS NOT NULL
       AND (m.retry_after, m.id) > (%(due_at)s::timestamptz, %(due_id)s::bigint)
     ORDER BY m.retry_after, m.id
     LIMIT %(limit)s)
    UNION ALL
    -- Scheduled rows written since the scheduled position with a time the due position has
    -- passed already (a row written with a past ETA): a claim's "fresh" part takes them.
    (SELECT m.id, m.task_name, m.schema_version, m.created_at, m.retry_after, m.retries,
            m.last_error
     FROM outbox_notify_message_v1 AS m
     WHERE m.retry_after IS NOT NULL
       AND (m.txid, m.id) > (%(sched_txid)s::xid8, %(sched_id)s::bigint)
       AND (m.retry_after, m.id) <= (%(due_at)s::timestamptz, %(due_id)s::bigint)
     ORDER BY m.txid, m.id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id, m.task_name, m.schema_version, m.created_at, m.retry_after, m.retries,
            m.last_error
     FROM outbox_notify_message_v1 AS m
     -- One index each (no OR across two indexes: the relay reads with bitmap scans off),
     -- then by id through the primary key (an array, not `IN (SELECT ...)`, which a generic
     -- plan could join to a read of the whole primary key, dead rows and all).
     WHERE m.id = ANY(ARRAY(SELECT r.id FROM outbox_notify_message_v1 AS r
                            WHERE r.id = ANY(%(recheck)s::bigint[])
                            UNION
                            SELECT r.id FROM outbox_notify_message_v1 AS r
                            WHERE r.txid = ANY(%(late)s::xid8[]) AND r.retry_after IS NULL
                            UNION
                            (SELECT r.id FROM outbox_notify_message_v1 AS r
                             WHERE r.txid = ANY(%(late)s::xid8[])
                               AND r.retry_after IS NOT NULL
                             ORDER BY r.txid, r.id)))  -- pinned to its index, as in the claim
       AND NOT coalesce(
           (m.retry_after IS NULL
            AND (m.txid, m.id) > (%(ready_txid)s::xid8, %(ready_id)s::bigint))
           OR (m.retry_after, m.id) > (%(due_at)s::timestamptz, %(due_id)s::bigint)
           OR (m.retry_after IS NOT NULL
               AND (m.txid, m.id) > (%(sched_txid)s::xid8, %(sched_id)s::bigint)),
           false))
)

-- name: _oldest_pending
-- An expression: the age in seconds of the oldest pending row, on the database's clock, or
-- 0. A row held until its ETA is not pending before its ETA, and its age counts from its ETA
-- after it; a row that failed counts from created_at, whenever its next try is; every other
-- row counts from created_at. Read from `pending` (see _pending) and from the rows that
-- failed (through the failed index, up to %(window)s of them: a million held rows cost
-- nothing).
greatest(
    (SELECT extract(epoch FROM clock_timestamp() - min(
                CASE WHEN p.retry_after IS NULL OR p.retries > 0 OR p.last_error IS NOT NULL
                         THEN p.created_at
                     WHEN p.retry_after <= now() THEN greatest(p.created_at, p.retry_after)
                END))
     FROM pending AS p),
    (SELECT extract(epoch FROM clock_timestamp() - min(f.created_at))
     FROM (SELECT m.created_at FROM outbox_notify_message_v1 AS m
           WHERE m.retries > 0 OR m.last_error IS NOT NULL
           ORDER BY m.retry_after, m.id
           LIMIT %(window)s) AS f),
    0)::float8

-- name: _snapshot_holder
-- A CTE `holder` (at most one row): what keeps vacuum from removing the outbox's dead rows,
-- the oldest first: another session's snapshot (pg_stat_activity.backend_xmin), a standby's
-- sent by hot_standby_feedback (pg_stat_replication), a replication slot's xmin, or a
-- prepared transaction. `xids`: how many transactions old it is; `seconds`: for how long it
-- has held it, where PostgreSQL says (a session's transaction, a prepared transaction).
-- Other roles' sessions show their xmin only to superusers and members of pg_read_all_stats:
-- what this role may not see is not reported.
holder AS MATERIALIZED (
    SELECT h.kind, h.xids, h.seconds, h.pid, h.name
    FROM (
        SELECT 'session' AS kind, age(a.backend_xmin) AS xids,
               extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.query_start))::float8
                   AS seconds,
               a.pid, coalesce(nullif(a.application_name, ''), a.usename::text, '') AS name
        FROM pg_stat_activity AS a
        -- Another database's sessions do not hold this database's tables back.
        WHERE a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid()
          AND a.datname = current_database()
        UNION ALL
        SELECT 'standby', age(r.backend_xmin), NULL, r.pid, coalesce(r.application_name, '')
        FROM pg_stat_replication AS r
        WHERE r.backend_xmin IS NOT NULL
        UNION ALL
        SELECT 'slot', age(s.xmin), NULL, s.active_pid, s.slot_name::text
        FROM pg_replication_slots AS s
        WHERE s.xmin IS NOT NULL
        UNION ALL
        SELECT 'prepared', age(p.transaction),
               extract(epoch FROM clock_timestamp() - p.prepared)::float8, NULL, p.gid
        FROM pg_prepared_xacts AS p
    ) AS h
    ORDER BY h.xids DESC
    LIMIT 1
)

-- name: _dead_rows
-- An expression: the outbox's dead rows, as the statistics system counts them (every row
-- deleted or updated since the last vacuum that could not remove it).
coalesce((SELECT s.n_dead_tup FROM pg_stat_user_tables AS s
          WHERE s.relid = 'outbox_notify_message_v1'::regclass), 0)::bigint

-- name: _dead_rows_held
-- An expression: how many of those dead rows a snapshot holds back, as far as the statistics
-- tell: the dead rows beyond the rows inserted since the table's last vacuum. A vacuum sets
-- n_dead_tup to the dead rows it had to leave and n_ins_since_vacuum to 0, and every outbox
-- row is inserted before it is deleted: the figure is near 0 while autovacuum keeps up,
-- however many rows a busy outbox deleted since its last round, and large once a vacuum ran
-- while an old snapshot held rows back. It overcounts by the rows that were live at that
-- vacuum and deleted since (a backlog drained after it), by retries' updates, and by the rows
-- deleted while that vacuum ran (a few thousand on a busy outbox), until the next round; it
-- counts the rows a snapshot holds only from the first vacuum after it began. An ANALYZE
-- replaces n_dead_tup by its sample's estimate (n_ins_since_vacuum stays): an estimate then.
greatest(coalesce((SELECT s.n_dead_tup - s.n_ins_since_vacuum FROM pg_stat_user_tables AS s
                   WHERE s.relid = 'outbox_notify_message_v1'::regclass), 0), 0)::bigint

-- name: _held
-- A condition: a held row whose ETA is still ahead.
retry_after > now() AND retries = 0 AND last_error IS NULL

-- name: _retrying
-- A condition: a row that failed (a retry or a broker outage sets last_error) whose next try
-- is not due yet. Read through the failed index, so held rows cost nothing.
(retries > 0 OR last_error IS NOT NULL) AND retry_after > now()
