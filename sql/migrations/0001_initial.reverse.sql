-- outbox-notify migration 0001_initial, reversed: drops what 0001_initial.sql created,
-- messages and dead letters included.
--
-- FROZEN, like 0001_initial.sql: `migrate outbox_notify zero` runs exactly this file.

DROP TRIGGER IF EXISTS outbox_notify_wake_v1 ON outbox_notify_message_v1;
DROP FUNCTION IF EXISTS outbox_notify_wake_v1();
DROP TABLE IF EXISTS outbox_notify_dead_letter_v1;
DROP TABLE IF EXISTS outbox_notify_message_v1;
