-- outbox-notify migration 0006_samples, reversed: no samples (the dashboard draws nothing).
--
-- FROZEN, like 0006_samples.sql.

DROP TABLE IF EXISTS outbox_notify_sample_v1;
