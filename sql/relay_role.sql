-- Least-privilege roles for outbox-notify (schema version 1).
--
-- Apply after sql/install.sql (or `migrate`), as the owner of the outbox tables:
--
--   psql -v ON_ERROR_STOP=1 -d yourdb -f sql/relay_role.sql
--
-- (from a pip install, write it out first: python -m outbox_notify.sql relay_role.sql > relay_role.sql)
--
-- It creates two group roles (NOLOGIN) and grants them what they need, nothing more. Give
-- them to your login roles yourself, so no password ever sits in this file:
--
--   GRANT outbox_notify_relay  TO my_relay_login;   -- runs manage.py outbox_listen / outbox_sweep
--   GRANT outbox_notify_writer TO my_app_login;     -- the application calling delay()/send_task()
--                                                   -- and its Celery workers (OnceTask)
--
-- Running it again is harmless: roles are created only when missing, grants are idempotent.
--
-- What needs no grant at all, because PostgreSQL gives it to every role: LISTEN and NOTIFY
-- (pg_notify), the advisory locks of the wake-up handshake (pg_advisory_lock,
-- pg_advisory_unlock, pg_try_advisory_xact_lock_shared), set_config() for the relay's
-- session timeouts, pg_notification_queue_usage(), reading pg_locks, and EXECUTE on the
-- trigger function (granted to PUBLIC when it is created).
--
-- Operator commands (outbox_stats, outbox_purge_dead_letter, outbox_requeue_dead_letter, the
-- admin) are not covered here: run them as the owner, or see docs/security.md.

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_notify_relay') THEN
        CREATE ROLE outbox_notify_relay NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_notify_writer') THEN
        CREATE ROLE outbox_notify_writer NOLOGIN;
    END IF;
END
$$;

-- Both roles reach the tables through their schema, wherever install.sql created them.
DO $$
BEGIN
    EXECUTE format(
        'GRANT USAGE ON SCHEMA %s TO outbox_notify_relay, outbox_notify_writer',
        (SELECT relnamespace::regnamespace::text
         FROM pg_class WHERE oid = 'outbox_notify_message_v1'::regclass)
    );
END
$$;

-- The relay (sql/queries.sql): claim_batch and peek are SELECT ... FOR UPDATE SKIP LOCKED,
-- which needs SELECT and UPDATE on at least one column; finalize_batch reschedules failed
-- rows (UPDATE of the three columns below, nothing else) and deletes published and dead rows
-- (DELETE ... RETURNING, which needs SELECT). The REVOKE first takes back a table-wide UPDATE
-- an earlier version of this script granted (and, with it, any column grants).
GRANT SELECT, DELETE ON outbox_notify_message_v1 TO outbox_notify_relay;
REVOKE UPDATE ON outbox_notify_message_v1 FROM outbox_notify_relay;
GRANT UPDATE (retries, retry_after, last_error) ON outbox_notify_message_v1 TO outbox_notify_relay;

-- The relay moves rows beyond saving to the dead letters; it never reads them back. It
-- counts them for its dead-letter gauge and the dashboard's samples: SELECT on the id alone
-- lets count(*) run and shows none of a message.
GRANT INSERT ON outbox_notify_dead_letter_v1 TO outbox_notify_relay;
GRANT SELECT (id) ON outbox_notify_dead_letter_v1 TO outbox_notify_relay;
GRANT SELECT, INSERT, UPDATE ON outbox_notify_frontier_v1 TO outbox_notify_relay;
-- One sample row per interval, and the retention's DELETE of old ones (its WHERE reads
-- a column: SELECT).
GRANT SELECT, INSERT, DELETE ON outbox_notify_sample_v1 TO outbox_notify_relay;

-- The writer: the one INSERT of the write side (insert_message), in the caller's transaction.
GRANT INSERT ON outbox_notify_message_v1 TO outbox_notify_writer;

-- The writer in a Celery worker, running OnceTask bodies (sql/inbox.sql): record_key is an
-- INSERT ... ON CONFLICT (scope, key) DO NOTHING, whose conflict target needs SELECT on those
-- columns besides INSERT; a skipped duplicate reads which delivery ran it (key_owner). The
-- relay never touches the inbox.
GRANT SELECT, INSERT ON outbox_notify_inbox_v1 TO outbox_notify_writer;

-- No sequence grants: the ids come from identity columns, and PostgreSQL checks an INSERT
-- that takes the next identity value against the table's INSERT privilege only (tested in
-- tests/integration/test_relay_role.py). USAGE on the sequences would add nextval()/currval()
-- for no use.
