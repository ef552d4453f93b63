-- outbox-notify migration 0006_samples: what the admin's Outbox dashboard draws.
--
-- FROZEN once released: `migrate` runs exactly this file; a later change is a new migration.
--
-- Each relay writes one row per sample interval (outbox_notify/relay/samples.py): what it
-- published, retried and dead-lettered since its previous row, the commit -> broker lag of
-- those batches, and the queue's gauges as it saw them. The same statement deletes the rows
-- older than a day, so the table stays at (relays x a day of intervals) rows: about 1,440
-- rows per relay at the default 60 s. Nothing else reads or writes it.
CREATE TABLE IF NOT EXISTS outbox_notify_sample_v1 (
    relay text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    host text NOT NULL,
    pid integer NOT NULL,
    mode text NOT NULL,
    seconds double precision NOT NULL,
    published integer NOT NULL,
    retried integer NOT NULL,
    dead_lettered integer NOT NULL,
    deferred integer NOT NULL,
    lag_p50_ms double precision,
    lag_p99_ms double precision,
    depth bigint NOT NULL,
    held bigint NOT NULL,
    retrying bigint NOT NULL,
    dead_letters bigint NOT NULL,
    dead_by_task json NOT NULL DEFAULT '{}',
    PRIMARY KEY (relay, at)
);

-- The dashboard reads the last hour and day of every relay, and the retention deletes by age.
CREATE INDEX IF NOT EXISTS outbox_notify_sample_v1_at_idx ON outbox_notify_sample_v1 (at);
