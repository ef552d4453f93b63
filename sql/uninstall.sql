-- Removes everything sql/install.sql created (the current schema): messages, dead letters and
-- the inbox's keys included. The migrations' own reverse files are in sql/migrations/.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/uninstall.sql
-- (from a pip install, write it out first: python -m outbox_notify.sql uninstall.sql > uninstall.sql)

DROP TABLE IF EXISTS outbox_notify_sample_v1;
DROP TABLE IF EXISTS outbox_notify_inbox_v1;
DROP TABLE IF EXISTS outbox_notify_frontier_v1;
DROP TRIGGER IF EXISTS outbox_notify_restamp_v1 ON outbox_notify_message_v1;
DROP FUNCTION IF EXISTS outbox_notify_restamp_v1();
DROP TRIGGER IF EXISTS outbox_notify_wake_v1 ON outbox_notify_message_v1;
DROP FUNCTION IF EXISTS outbox_notify_wake_v1();
DROP TABLE IF EXISTS outbox_notify_dead_letter_v1;
DROP TABLE IF EXISTS outbox_notify_message_v1;
