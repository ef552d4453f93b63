-- outbox-notify migration 0005_frontier, reversed: the indexes of 0003_held and 0001_initial
-- again, no txid, no restamping trigger, no saved frontiers, the table's default autovacuum
-- settings.
--
-- FROZEN, like 0005_frontier.sql. Relays of this version must be stopped first: their claims
-- need the txid column. Every statement also runs when the outbox table was dropped behind
-- Django's back (the W001 check's hint migrates down through here).

DROP TABLE IF EXISTS outbox_notify_frontier_v1;
DROP TRIGGER IF EXISTS outbox_notify_restamp_v1 ON outbox_notify_message_v1;
DROP FUNCTION IF EXISTS outbox_notify_restamp_v1();
DROP INDEX IF EXISTS outbox_notify_message_v1_failed_idx;
DROP INDEX IF EXISTS outbox_notify_message_v1_scheduled_txid_idx;
DROP INDEX IF EXISTS outbox_notify_message_v1_scheduled_idx;
DROP INDEX IF EXISTS outbox_notify_message_v1_ready_txid_idx;
DO $$
BEGIN
    IF to_regclass('outbox_notify_message_v1') IS NOT NULL THEN
        ALTER TABLE outbox_notify_message_v1 RESET (
            autovacuum_vacuum_scale_factor,
            autovacuum_vacuum_threshold,
            autovacuum_vacuum_cost_delay
        );
        CREATE INDEX outbox_notify_message_v1_retry_after_idx
            ON outbox_notify_message_v1 (retry_after)
            WHERE retry_after IS NOT NULL;
        CREATE INDEX outbox_notify_message_v1_ready_idx
            ON outbox_notify_message_v1 (id)
            WHERE retry_after IS NULL;
        ALTER TABLE outbox_notify_message_v1 DROP COLUMN txid;
    END IF;
END
$$;
