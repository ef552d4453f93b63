-- outbox-notify migration 0004_inbox, reversed: drops the inbox and every key in it.
--
-- FROZEN, like 0004_inbox.sql: `migrate outbox_notify 0003_held` runs exactly this file.

DROP TABLE IF EXISTS outbox_notify_inbox_v1;
