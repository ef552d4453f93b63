-- outbox-notify migration 0003_held: an index of the rows that are ready now, so that rows
-- held until their ETA (OUTBOX_NOTIFY_HOLD_ETA_AFTER) never stand in the way of a claim.
--
-- FROZEN once released: `migrate` runs exactly this file; a later change is a new migration.
--
-- A held row is an ordinary outbox row whose retry_after is its ETA, so the claim's existing
-- predicate (retry_after IS NULL OR retry_after <= now()) already keeps it back until then.
-- What changes is how the claim finds ready rows: in id order through the primary key it
-- would step over every held row first (a million held rows: ~0.5 s per claim). This partial
-- index holds only the rows with no retry_after, in claim order; due retries and due held
-- rows are found through outbox_notify_message_v1_retry_after_idx.
--
-- CREATE INDEX (not CONCURRENTLY: migrations run in a transaction) blocks writes to the
-- outbox for as long as it reads the table, which a drained outbox makes short.

CREATE INDEX outbox_notify_message_v1_ready_idx
    ON outbox_notify_message_v1 (id)
    WHERE retry_after IS NULL;
