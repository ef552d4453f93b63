-- outbox-notify migration 0005_frontier: claims that start where the previous one ended, so
-- no claim walks the rows already published (docs/concepts.md, "Claims and dead rows").
--
-- FROZEN once released: `migrate` runs exactly this file; a later change is a new migration.
--
-- A deleted row stays in the table and in every index until no snapshot can see it any more.
-- While some transaction holds an old snapshot (a pg_dump, an idle session, a replica with
-- hot_standby_feedback, a replication slot), every claim that read an index from its start
-- paid for every row published since. Claims now read from a frontier the relay keeps: the
-- position, in each index, of the last row it passed. Three things make that exact:
--
--   * txid: the top-level transaction that wrote the row (its INSERT, or its last UPDATE), on
--     which the relay orders "ready" and newly scheduled rows. A transaction in progress at a
--     claim's snapshot is remembered by the relay and its rows are looked up by txid once it
--     ends, so a row that commits late is claimed at its commit, however old its id.
--   * outbox_notify_restamp_v1: any UPDATE (a retry rescheduled, an operator's reset) stamps
--     the updating transaction, so an updated row is new to every relay's frontier.
--   * indexes ordered as the claims read them: ready rows by (txid, id); scheduled rows by
--     (retry_after, id) for the ones falling due, and by (txid, id) for the ones just written.
--
-- Rows written before the migration get the migration's own transaction id. Writers of the
-- previous version need no change: they omit txid, and the default fills it in. Relays of the
-- previous version keep publishing correctly during a rolling deploy (their claim reads the
-- primary key instead of the dropped "ready now" index: slower, not wrong).
--
-- ALTER TABLE and CREATE INDEX (not CONCURRENTLY: migrations run in a transaction) block
-- writes to the outbox while they run, which a drained outbox makes short. Adding the column
-- rewrites no row: its default is stable, so PostgreSQL evaluates it once, here, and keeps the
-- value for the rows already present (the migration's own transaction id, as an UPDATE of
-- every row would set, without the UPDATE's time under the lock and dead copy of each row).
-- Rows written later evaluate the default as they are inserted.

ALTER TABLE outbox_notify_message_v1
    ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id();

CREATE OR REPLACE FUNCTION outbox_notify_restamp_v1() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    NEW.txid := pg_current_xact_id();
    RETURN NEW;
END;
$$;

CREATE TRIGGER outbox_notify_restamp_v1
    BEFORE UPDATE ON outbox_notify_message_v1
    FOR EACH ROW
    EXECUTE FUNCTION outbox_notify_restamp_v1();

DROP INDEX outbox_notify_message_v1_ready_idx;
DROP INDEX outbox_notify_message_v1_retry_after_idx;

CREATE INDEX outbox_notify_message_v1_ready_txid_idx
    ON outbox_notify_message_v1 (txid, id)
    WHERE retry_after IS NULL;

CREATE INDEX outbox_notify_message_v1_scheduled_idx
    ON outbox_notify_message_v1 (retry_after, id)
    WHERE retry_after IS NOT NULL;

CREATE INDEX outbox_notify_message_v1_scheduled_txid_idx
    ON outbox_notify_message_v1 (txid, id)
    WHERE retry_after IS NOT NULL;

-- Rows that failed at least once (retrying, or deferred by a broker outage): what
-- outbox_stats counts as retrying and ranks in top_failing, without reading the held rows
-- of the scheduled index (a million held rows cost those figures nothing).
CREATE INDEX outbox_notify_message_v1_failed_idx
    ON outbox_notify_message_v1 (retry_after, id)
    WHERE retries > 0 OR last_error IS NOT NULL;

-- Where a relay's claims stand (outbox_notify/relay/frontier.py), saved now and then by every
-- relay for the relays and sweeps that start after it: one row per schema version a relay
-- reads up to. A relay starting without it reads every index once from its start.
CREATE TABLE IF NOT EXISTS outbox_notify_frontier_v1 (
    max_version smallint PRIMARY KEY,
    state json NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT now()
);

-- A queue table turns over its whole content every few seconds: vacuum it once a thousand
-- rows are dead rather than once a fifth of the table is, and at full speed, so that the
-- space a long snapshot held back is free again (and the heap's empty tail truncated) within
-- one autovacuum round after the snapshot ends.
ALTER TABLE outbox_notify_message_v1 SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
