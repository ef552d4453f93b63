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
-- Claims up to %(limit)s claimable rows for this relay's open transaction, reading each index
-- from the relay's frontier (outbox_notify/relay/frontier.py), never from its start: a row
-- published and deleted stays in the indexes until no snapshot can see it, and a claim that
-- started at the beginning would step over every one of them (docs/concepts.md, "Claims and
-- dead rows"). The row locks are the claim: another relay's SKIP LOCKED passes over them, and
-- PostgreSQL releases them the moment this relay commits, rolls back or dies. Rows of a newer
-- schema_version are left for a newer relay.
--
-- Five parts, read in this order as far as the LIMIT asks (`part` tells which found a row):
--   0 recheck  rows passed earlier while another session held them, or released, by id;
--   1 late     rows of transactions that were in progress at earlier claims, by txid;
--   2 due      scheduled rows (retries, held rows) fallen due since the due frontier;
--   3 fresh    scheduled rows written since the scheduled frontier that are due already
--              (up to %(walk)s new ones are read; the rest wait for the due part);
--   4 ready    rows with no retry_after after the ready frontier, in (txid, id) order.
-- The recheck and late parts (and their lists in the last row) sit between `-- optional:`
-- markers: the relay runs the claim without them while it has no row to recheck, or no
-- transaction to look up (sql.without(); outbox_notify/relay/store.py), which is most claims:
-- a part with nothing to read returned nothing, but PostgreSQL still set up its scans.
-- A last row (part -1) carries what the relay needs to move its frontier: the snapshot's
-- running transactions, the statement's time, and the rows of each part it read but could not
-- take (locked by someone else, or beyond the LIMIT), to be read again by id.
--
-- `since` is, for a held row, its ETA: the relay's lag metric counts from the moment a row
-- became publishable; `age` is that moment's age at the claim, on the database's clock.
-- Due means retry_after <= statement_timestamp(): the statement's own time, which only grows
-- from one claim to the next, even across the relay's two claim connections.
WITH
-- Only `due` is a CTE (`fresh` reads it too): the other parts are subqueries of `picked`, so
-- their rows are copied once, into `picked`, not first into a CTE of their own.
due AS (
    SELECT m.*, 2 AS part FROM outbox_notify_message_v1 AS m
    WHERE
    -- include: _due_rows
    ORDER BY m.retry_after, m.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
walked AS MATERIALIZED (
    SELECT w.id, w.txid, w.retry_after, w.schema_version FROM outbox_notify_message_v1 AS w
    WHERE
    -- include: _walked_rows
    ORDER BY w.txid, w.id
    LIMIT %(walk)s
),
picked AS MATERIALIZED (
    -- optional: recheck
    SELECT * FROM (
        SELECT m.*, 0 AS part FROM outbox_notify_message_v1 AS m
        WHERE
        -- include: _recheck_rows
        FOR UPDATE SKIP LOCKED) AS rechecked
    UNION ALL
    -- end optional: recheck
    -- optional: late
    SELECT * FROM (
        SELECT m.*, 1 AS part FROM outbox_notify_message_v1 AS m
        WHERE
        -- include: _late_ready_rows
        ORDER BY m.txid, m.id  -- as its index is, which pins the read to it (see ready_left)
        FOR UPDATE SKIP LOCKED) AS late_ready
    UNION ALL
    SELECT * FROM (
        SELECT m.*, 1 AS part FROM outbox_notify_message_v1 AS m
        WHERE
        -- include: _late_due_rows
        ORDER BY m.txid, m.id
        FOR UPDATE SKIP LOCKED) AS late_due
    UNION ALL
    -- end optional: late
    SELECT * FROM due
    UNION ALL
    SELECT * FROM (
        SELECT m.*, 3 AS part FROM outbox_notify_message_v1 AS m
        -- include: _fresh_lookup
          AND m.id NOT IN (SELECT id FROM due)
        FOR UPDATE SKIP LOCKED) AS fresh
    UNION ALL
    SELECT * FROM (
        SELECT m.*, 4 AS part FROM outbox_notify_message_v1 AS m
        WHERE
        -- include: _ready_rows
        ORDER BY m.txid, m.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED) AS ready
    LIMIT %(limit)s
),
-- How far the due and ready parts read: to their last row taken (the claim filled up), or
-- to their end (it did not). Aggregates, not ORDER BY ... LIMIT 1: the claim runs with sorts
-- disabled. Two passes over `picked`: the last time and txid, then the last id at each.
ends AS MATERIALIZED (
    SELECT count(*) AS n,
           max(p.part) AS last_part,
           max(p.retry_after) FILTER (WHERE p.part = 2) AS due_at,
           max(p.txid) FILTER (WHERE p.part = 4) AS ready_txid,
           (SELECT max(txid) FROM walked) AS walked_txid
    FROM picked AS p
),
bounds AS MATERIALIZED (
    SELECT e.n < %(limit)s AS exhausted,
           e.last_part,
           e.due_at,
           l.due_id,
           e.ready_txid,
           l.ready_id,
           e.walked_txid,
           (SELECT max(w.id) FROM walked AS w WHERE w.txid = e.walked_txid) AS walked_id,
           e.n
    FROM ends AS e,
         LATERAL (SELECT max(p.id) FILTER (WHERE p.part = 2 AND p.retry_after = e.due_at)
                             AS due_id,
                         max(p.id) FILTER (WHERE p.part = 4 AND p.txid = e.ready_txid)
                             AS ready_id
                  FROM picked AS p) AS l
),
-- Where the *_left lists stop reading: the last row taken, or the end of the index when the
-- claim was not full. One bound, not `exhausted OR ...`, so it is the index scan's condition:
-- with an OR it was a filter, and each claim of a large backlog read every row left in it.
upto AS MATERIALIZED (
    SELECT CASE WHEN b.exhausted THEN 'infinity' ELSE b.due_at END AS due_at,
           CASE WHEN b.exhausted THEN 9223372036854775807 ELSE b.due_id END AS due_id,
           CASE WHEN b.exhausted THEN '18446744073709551615'::xid8 ELSE b.ready_txid END
               AS ready_txid,
           CASE WHEN b.exhausted THEN 9223372036854775807 ELSE b.ready_id END AS ready_id
    FROM bounds AS b
),
snap AS MATERIALIZED (SELECT pg_current_snapshot() AS s)
SELECT part, id, task_id, task_name, args::text, kwargs::text, options::text, context::text,
       retries, schema_version, since,
       greatest(date_part('epoch', now() - since), 0)::float8 AS age,
       txid::text, retry_after, NULL::json AS meta
FROM (SELECT p.*,
             CASE WHEN p.retries = 0 AND p.last_error IS NULL AND p.retry_after IS NOT NULL
                  THEN greatest(p.created_at, p.retry_after) ELSE p.created_at END AS since
      FROM picked AS p) AS rows
UNION ALL
SELECT -1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
    json_build_object(
        'n', (SELECT n FROM bounds),
        'at', statement_timestamp(),
        'xmax', (SELECT pg_snapshot_xmax(s)::text FROM snap),
        'xip', ARRAY(SELECT x::text FROM snap, pg_snapshot_xip(s) AS x),
        -- The rows the recheck and late parts passed, only when the part was read to its end
        -- (the claim did not fill up, or a later part took a row): otherwise the relay
        -- reads the part again next time and ignores these lists, and a late transaction of
        -- 50,000 rows made every claim of its rows read all those left.
        -- optional: recheck
        'recheck_left', CASE WHEN (SELECT exhausted OR last_part > 0 FROM bounds) THEN ARRAY(
            SELECT m.id FROM outbox_notify_message_v1 AS m
            WHERE
            -- include: _recheck_rows
              AND m.id NOT IN (SELECT id FROM picked)) END,
        -- end optional: recheck
        -- optional: late
        'late_left', CASE WHEN (SELECT exhausted OR last_part > 1 FROM bounds) THEN ARRAY(
            (SELECT m.id FROM outbox_notify_message_v1 AS m
             WHERE
             -- include: _late_ready_rows
               AND m.id NOT IN (SELECT id FROM picked)
             ORDER BY m.txid, m.id)
            UNION ALL
            (SELECT m.id FROM outbox_notify_message_v1 AS m
             WHERE
             -- include: _late_due_rows
               AND m.id NOT IN (SELECT id FROM picked)
             ORDER BY m.txid, m.id)) END,
        -- end optional: late
        -- The due and ready parts' rows left behind, from the frontier to `upto`, each part
        -- read in three pieces so that every read is bounded at both ends by its index and
        -- none can read an index from its start, whatever the statistics. The claim keeps one
        -- generic plan, made again after autovacuum rounds, and the planner does not see dead
        -- entries: some rounds' statistics made a read through the primary key look as cheap
        -- (one read's only condition on it was `m.id <= ...`; it stepped over every dead row
        -- an old snapshot kept: 1,926 pages a claim at 100,000 of them, and in the old-snapshot
        -- benchmark a p50 that climbed to 60 ms until the next replan).
        --   same  `upto` in the frontier's own time or transaction: the ids between the two,
        --         an equality and an id range (tight on its index; the primary key could only
        --         serve it between the two ids, both rows this claim or the last one took);
        --   on    from the frontier to `upto`'s time or transaction: a row comparison starts
        --         the read at the frontier, a bound on the first column ends it;
        --   upto  `upto`'s own time or transaction, when it is past the frontier's: a range
        --         on the first column (not an equality, which would leave any index ordered
        --         by id to do), the id bounded where no index can serve it.
        -- Each is ordered as its index is, which pins it to that index (sorts are off).
        -- `upto` is at the end of the index (infinity) when the claim did not fill up.
        'due_left', ARRAY(
            (SELECT m.id FROM outbox_notify_message_v1 AS m
             WHERE m.retry_after = %(due_at)s::timestamptz AND m.id > %(due_id)s::bigint
               AND m.id <= (SELECT due_id FROM upto)
               AND (SELECT due_at FROM upto) = %(due_at)s::timestamptz
               AND m.retry_after <= statement_timestamp()
               AND m.schema_version <= %(max_version)s
               AND m.id NOT IN (SELECT id FROM picked)
             ORDER BY m.retry_after, m.id)
            UNION ALL
            (SELECT m.id FROM outbox_notify_message_v1 AS m
             WHERE (m.retry_after, m.id) > (%(due_at)s::timestamptz, %(due_id)s::bigint)
               AND m.retry_after < (SELECT due_at FROM upto)
               AND m.retry_after <= statement_timestamp()
               AND m.schema_version <= %(max_version)s
               AND m.id NOT IN (SELECT id FROM picked)
             ORDER BY m.retry_after, m.id)
            UNION ALL
            (SELECT m.id FROM outbox_notify_message_v1 AS m
             WHERE m.retry_after >= (SELECT due_at FROM upto)
               AND m.retry_after <= (SELECT due_at FROM upto)
               AND m.retry_after > %(due_at)s::timestamptz
               AND m.id + 0 <= (SELECT due_id FROM upto)
               AND m.retry_after <= statement_timestamp()
               AND m.schema_version <= %(max_version)s
               AND m.id NOT IN (SELECT id FROM picked)
             ORDER BY m.retry_after, m.id)),
        'walked_end', (SELECT json_build_array(b.walked_txid::text, b.walked_id) FROM bounds AS b
                       WHERE b.walked_txid IS NOT NULL),
        'walked_n', (SELECT count(*) FROM walked),
        'walked_left', ARRAY(
            SELECT w.id FROM walked AS w
            WHERE w.retry_after <= statement_timestamp()
              AND w.schema_version <= %(max_version)s
              AND w.id NOT IN (SELECT id FROM picked)),
        'ready_left', (
            SELECT json_agg(json_build_array(l.txid::text, l.id)) FROM (
                (SELECT m.txid, m.id FROM outbox_notify_message_v1 AS m
                 WHERE m.retry_after IS NULL
                   AND m.txid = %(ready_txid)s::xid8 AND m.id > %(ready_id)s::bigint
                   AND m.id <= (SELECT ready_id FROM upto)
                   AND (SELECT ready_txid FROM upto) = %(ready_txid)s::xid8
                   AND m.schema_version <= %(max_version)s
                   AND m.id NOT IN (SELECT id FROM picked)
                 ORDER BY m.txid, m.id)
                UNION ALL
                (SELECT m.txid, m.id FROM outbox_notify_message_v1 AS m
                 WHERE m.retry_after IS NULL
                   AND (m.txid, m.id) > (%(ready_txid)s::xid8, %(ready_id)s::bigint)
                   AND m.txid < (SELECT ready_txid FROM upto)
                   AND m.schema_version <= %(max_version)s
                   AND m.id NOT IN (SELECT id FROM picked)
                 ORDER BY m.txid, m.id)
                UNION ALL
                (SELECT m.txid, m.id FROM outbox_notify_message_v1 AS m
                 WHERE m.retry_after IS NULL
                   AND m.txid >= (SELECT ready_txid FROM upto)
                   AND m.txid <= (SELECT ready_txid FROM upto)
                   AND m.txid > %(ready_txid)s::xid8
                   AND m.id + 0 <= (SELECT ready_id FROM upto)
                   AND m.schema_version <= %(max_version)s
                   AND m.id NOT IN (SELECT id FROM picked)
                 ORDER BY m.txid, m.id)) AS l)
    );

-- name: ensure_frontier_row
-- The row this relay's schema version saves its frontier in (one per version: a relay loads
-- only what a relay reading at least its versions saved, see load_frontier).
INSERT INTO outbox_notify_frontier_v1 (max_version, state)
VALUES (%(max_version)s, '{}')
ON CONFLICT (max_version) DO NOTHING;

-- name: load_frontier
-- The newest frontier saved by a relay that reads every schema version this one reads: rows
-- of a newer version it passed over are rows this relay could not publish either (NULL when
-- none is saved). With it, where this database stands: its next transaction id and its clock
-- (epoch seconds: a Django cursor without USE_TZ would give a naive time).
-- A frontier ahead of them was saved in another cluster (pg_dump and restore, a move by
-- logical replication) or after the point a point-in-time recovery went back to: every new
-- row would be behind it (Frontier.check).
SELECT (SELECT f.state FROM outbox_notify_frontier_v1 AS f
        WHERE f.max_version >= %(max_version)s AND f.state::text <> '{}'
        ORDER BY f.saved_at DESC
        LIMIT 1) AS state,
       pg_snapshot_xmax(pg_current_snapshot())::text AS xmax,
       date_part('epoch', statement_timestamp())::float8 AS now;

-- name: restamp_copied_rows
-- Rows copied in from another cluster (pg_restore keeps each row's txid) may carry txids this
-- database has not handed out yet. They sort after every new row, and a claim that takes them
-- stops the frontier at the database's own next transaction (Frontier.absorb): every later
-- claim would read them again, published and dead, until vacuum removed them. Touching them
-- stamps them with this transaction (the UPDATE trigger), in order with the rest: up to
-- %(limit)s of each kind a transaction (the relay repeats it while it finds that many, and
-- the trigger stamped them all). Rows another session holds are left for the next connect.
-- Run under set_claim_timeout's planner settings: two probes at the ends of the txid indexes
-- when there are none, which is always but after a restore.
-- Each read is ordered as its txid index is, and the update looks its rows up by id: no plan
-- reads an index from its start (see claim_batch's due_left).
WITH ready AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE m.retry_after IS NULL AND m.txid >= pg_snapshot_xmax(pg_current_snapshot())
    ORDER BY m.txid, m.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), scheduled AS (
    SELECT m.id FROM outbox_notify_message_v1 AS m
    WHERE m.retry_after IS NOT NULL AND m.txid >= pg_snapshot_xmax(pg_current_snapshot())
    ORDER BY m.txid, m.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), stamped AS (
    UPDATE outbox_notify_message_v1 SET retry_after = retry_after
    WHERE id = ANY(ARRAY(SELECT id FROM ready UNION ALL SELECT id FROM scheduled))
    RETURNING txid
)
-- How many, and how many the trigger did not stamp (disabled, or a replica's session role):
-- those would be found again at every pass.
SELECT count(*) AS n, count(*) FILTER (WHERE txid <> pg_current_xact_id()) AS unstamped
FROM stamped;

-- name: cluster_identity
-- Whose transaction ids a frontier's positions are: this cluster's system identifier and the
-- timeline of its history it is on. A restore elsewhere and a move by logical replication
-- give another identifier; a failover and a point-in-time recovery start a new timeline (read
-- from the current WAL file's name: the last checkpoint's can lag a fast promotion). Run on
-- its own, since a role or a server may refuse it (Frontier.check then relies on txids).
SELECT s.system_identifier::text || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)
FROM pg_control_system() AS s;

-- name: save_frontier
-- Saves this relay's frontier for the relays and sweeps that start later, unless another
-- relay's open claim is saving it right now (then that one's will do).
UPDATE outbox_notify_frontier_v1 SET state = %(state)s::json, saved_at = now()
WHERE max_version IN (SELECT f.max_version FROM outbox_notify_frontier_v1 AS f
                      WHERE f.max_version = %(max_version)s
                      FOR UPDATE SKIP LOCKED);

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
-- Before sleeping: is there a row this relay could claim now, is there one another session
-- holds (it may let it go), and in how many seconds does the next retry or held row fall
-- due? Every test reads from the relay's frontier (see _claimable), so neither held rows nor
-- the rows already published cost anything here.
WITH
-- include: _claimable
SELECT
    f.claimable,
    f.claimable
    OR EXISTS (
        SELECT 1 FROM outbox_notify_message_v1 AS m
        WHERE
        -- include: _recheck_rows
    -- The two EXISTS below read a subquery ordered as its index is, with a LIMIT: that pins
    -- the read to the index (sorts are off; EXISTS itself drops an ORDER BY). Otherwise a
    -- generic plan read the scheduled rows' (txid, id) index from its start for the due test,
    -- past every held row and every dead one.
    ) OR EXISTS (
        SELECT 1 FROM (
            SELECT m.id FROM outbox_notify_message_v1 AS m
            WHERE
            -- include: _ready_rows
            ORDER BY m.txid, m.id
            LIMIT 1) AS ready
    ) OR EXISTS (
        SELECT 1 FROM (
            SELECT m.id FROM outbox_notify_message_v1 AS m
            WHERE
            -- include: _due_rows
            ORDER BY m.retry_after, m.id
            LIMIT 1) AS due
    ) AS due,
    -- The next due time: the first scheduled row from now on, in the scheduled index's order
    -- (as `min(retry_after)`, a generic plan could read a whole partial index instead).
    (SELECT extract(epoch FROM n.retry_after - statement_timestamp())::float8
     FROM (SELECT m.retry_after FROM outbox_notify_message_v1 AS m
           WHERE m.retry_after > statement_timestamp()
           ORDER BY m.retry_after, m.id
           LIMIT 1) AS n) AS next_due_in
FROM found AS f;

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
-- The plan is therefore the same whatever the parameters: the prepared claim keeps its
-- generic plan instead of planning its dozen parts again at every claim (planning cost more
-- than running a claim of 100 rows: a drain of 20,000 rows here, 10.5 -> 6.4 ms per claim).
SELECT set_config('idle_in_transaction_session_timeout', %(timeout_ms)s, true),
       set_config('jit', 'off', true),
       set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true),
       set_config('enable_sort', 'off', true),
       set_config('plan_cache_mode', 'force_generic_plan', true);

-- name: set_claim_lock_wait
-- A claim made while this relay already holds another one must not queue behind a lock
-- request that waits for that other claim (a TRUNCATE, an ALTER TABLE, a migration): the
-- relay would wait for itself. Nor may it run long for any other reason (a server starved of
-- CPU or I/O): the claim in flight on the other connection is waiting for it, and must end
-- within --stale-timeout. Transaction-local, and only for the claim itself.
SELECT set_config('lock_timeout', %(wait)s, true),
       set_config('statement_timeout', %(wait)s, true);

-- name: reset_claim_lock_wait
-- After the claim: the finalising statements wait for locks as the session does...
SET LOCAL lock_timeout TO DEFAULT;

-- name: reset_claim_statement_timeout
-- ... and may take as long as the session lets them.
SET LOCAL statement_timeout TO DEFAULT;

-- name: listen
LISTEN outbox_notify_v1;

-- name: listen_probe
LISTEN outbox_notify_v1_probe;

-- name: unlisten_probe
UNLISTEN outbox_notify_v1_probe;

-- name: notify_probe
SELECT pg_notify('outbox_notify_v1_probe', %(payload)s);

-- name: set_listen_plan
-- The LISTEN connection's peeks and waits read the indexes in order whatever the table's
-- statistics say, as claims do (set_claim_timeout), without JIT compiling them, and keep
-- their generic plan once prepared: left to choose, PostgreSQL found the peek's custom plans
-- cheaper (they drop the parts a one-time filter turns off) and planned it at every peek.
-- Session-wide: this connection LISTENs only once the probe showed it is a session of its
-- own (direct, or a session pooler, which resets sessions between clients: DISCARD ALL).
SELECT set_config('jit', 'off', false),
       set_config('enable_seqscan', 'off', false),
       set_config('enable_bitmapscan', 'off', false),
       set_config('enable_sort', 'off', false),
       set_config('plan_cache_mode', 'force_generic_plan', false);

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
-- sleeping relay speaks on this connection at least once per sweep interval, and keeps the
-- lock through a drain only when the drain's longest batch fits in what is left of that
-- silence (Listener.may_keep_lock).
SELECT set_config('idle_session_timeout', %(timeout_ms)s, false), pg_advisory_lock(1869968482, 1);

-- name: release_wake_lock_bounded
SELECT pg_advisory_unlock(1869968482, 1), set_config('idle_session_timeout', '0', false);

-- name: await_wake_lock
-- While writers' open transactions hold the wake lock (a writer inserted while every relay
-- was draining, and keeps its transaction open): if a row is claimable now, say so and do not
-- queue; otherwise queue for the lock for at most the session's lock_timeout. The writers'
-- commit hands the lock over at once, so their rows are found without delay; a lock timeout
-- (an error) means they still hold it. The CASE evaluates the lock only when nothing is
-- claimable (tested from the relay's frontier, see _claimable). One statement per
-- lock_timeout is all a relay spends waiting for writers.
WITH
-- include: _claimable
SELECT claimable,
       CASE WHEN claimable THEN false
            ELSE (SELECT true FROM pg_advisory_lock(1869968482, 1))
       END AS locked
FROM found;

-- name: await_wake_lock_bounded
-- await_wake_lock on PostgreSQL 14+, setting idle_session_timeout with the lock as
-- take_wake_lock_bounded does (set_config is undone with the statement on a lock timeout).
WITH
-- include: _claimable
SELECT claimable,
       CASE WHEN claimable THEN false
            ELSE (SELECT true FROM pg_advisory_lock(1869968482, 1)
                  WHERE set_config('idle_session_timeout', %(timeout_ms)s, false) IS NOT NULL)
       END AS locked
FROM found;

-- name: queue_gauges
-- The relay's gauges, from the outbox table and from statistics views every role may read,
-- the table read from the relay's frontier (the _pending fragment), never from the start of
-- an index: the depth, exact up to %(limit)s rows and beyond that the planner's way of
-- estimating it (rows per page at the last ANALYZE times the table's pages now); the oldest
-- pending row's age (_oldest_pending, as outbox_stats reports it); the dead rows
-- (_dead_rows), how many of them a snapshot holds back (_dead_rows_held) and the oldest
-- snapshot holding them back (_snapshot_holder). Beside them, the rows held until an ETA
-- still ahead (_held, through the scheduled index from now on)
-- and those waiting for a retry (_retrying, through the failed index from now on), each
-- count stopping after %(limit)s rows, and the relays' sessions waiting on LISTEN (as
-- outbox_stats's relay_sessions counts them). The dead letters are another statement
-- (count_dead_letters): the relay role may not read that table, and one unreadable table
-- here would cost every gauge.
WITH
-- include: _pending
,
-- include: _snapshot_holder
SELECT
    (SELECT count(*) FROM pending) AS counted,
    (SELECT CASE WHEN c.relpages > 0 AND c.reltuples > 0
                 THEN (c.reltuples / c.relpages
                       * (pg_relation_size(c.oid) / current_setting('block_size')::float8))
            END
     FROM pg_class AS c
     WHERE c.oid = 'outbox_notify_message_v1'::regclass)::float8 AS estimated,
    -- include: _oldest_pending
        AS oldest_seconds,
    -- include: _dead_rows
        AS dead_rows,
    -- include: _dead_rows_held
        AS dead_rows_held,
    h.kind, h.xids, h.seconds, h.pid, h.name,
    (SELECT count(*) FROM (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE
        -- include: _held
        ORDER BY retry_after, id  -- as its index is: no other index will do
        LIMIT %(limit)s) AS capped) AS held,
    (SELECT count(*) FROM (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE
        -- include: _retrying
        ORDER BY retry_after, id  -- as its index is: no other index will do
        LIMIT %(limit)s) AS capped) AS retrying,
    (SELECT count(*) FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'outbox_notify.listen')
        AS relays_listening
FROM (SELECT 1) AS one
LEFT JOIN holder AS h ON true;

-- name: dead_letters_readable
-- Whether this role may count the dead letters (SELECT on any column of the table will do:
-- sql/relay_role.sql grants the id only, never the messages).
SELECT has_any_column_privilege('outbox_notify_dead_letter_v1', 'SELECT');

-- name: count_dead_letters
-- The dead letters, the count stopping after %(limit)s rows (a table without churn of
-- published rows: nothing to skip).
SELECT count(*) FROM (SELECT 1 FROM outbox_notify_dead_letter_v1 LIMIT %(limit)s) AS capped;

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

-- name: record_sample
-- One row of outbox_notify_sample_v1 (the admin's Outbox dashboard): what this relay did
-- since its previous row and the gauges it just read, with the rows of held and retrying
-- messages and of dead letters counted here, each count stopping after %(limit)s rows (held
-- rows through the scheduled index from now on, failed ones through the failed index). The
-- same statement deletes the samples older than %(keep_seconds)s, so the table stays small
-- without a purge job; at one row per relay per interval, that delete is a few rows each time.
WITH old AS (
    DELETE FROM outbox_notify_sample_v1
    WHERE at < now() - make_interval(secs => %(keep_seconds)s)
)
INSERT INTO outbox_notify_sample_v1 (
    relay, host, pid, mode, seconds, published, retried, dead_lettered, deferred,
    lag_p50_ms, lag_p99_ms, depth, held, retrying, dead_letters, dead_by_task
)
SELECT
    %(relay)s, %(host)s, %(pid)s, %(mode)s, %(seconds)s, %(published)s, %(retried)s,
    %(dead_lettered)s, %(deferred)s, %(lag_p50_ms)s, %(lag_p99_ms)s, %(depth)s,
    (SELECT count(*) FROM (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE
        -- include: _held
        ORDER BY retry_after, id  -- as its index is: no other index will do
        LIMIT %(limit)s) AS capped),
    (SELECT count(*) FROM (
        SELECT 1 FROM outbox_notify_message_v1
        WHERE
        -- include: _retrying
        ORDER BY retry_after, id  -- as its index is: no other index will do
        LIMIT %(limit)s) AS capped),
    (SELECT count(*) FROM (
        SELECT 1 FROM outbox_notify_dead_letter_v1 LIMIT %(limit)s) AS capped),
    %(dead_by_task)s
ON CONFLICT (relay, at) DO NOTHING;
