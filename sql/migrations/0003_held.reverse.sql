-- outbox-notify migration 0003_held, reversed: drops the index of ready rows.
--
-- FROZEN, like 0003_held.sql. Rows held until their ETA stay correct without it (their
-- retry_after keeps every relay from claiming them early); claims only get slower.

DROP INDEX IF EXISTS outbox_notify_message_v1_ready_idx;
