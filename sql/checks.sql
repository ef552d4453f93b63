-- Queries of the system checks and of the relay commands' start-up check (outbox_notify/checks.py,
-- outbox_notify/management/commands/_common.py), loaded by name like sql/queries.sql.
--
-- Each section starts with a `-- name: NAME` line. Parameters use psycopg's %(name)s style.

-- name: schema_state
-- Which outbox objects exist, the wake-up trigger's pg_trigger.tgenabled (NULL: no trigger),
-- whether Django recorded an outbox migration as applied, and whether the inbox exists.
SELECT
    to_regclass('outbox_notify_message_v1') IS NOT NULL AS message_table,
    to_regclass('outbox_notify_dead_letter_v1') IS NOT NULL AS dead_letter_table,
    to_regprocedure('outbox_notify_wake_v1()') IS NOT NULL AS wake_function,
    (SELECT tgenabled::text FROM pg_trigger
     WHERE tgname = 'outbox_notify_wake_v1' AND NOT tgisinternal) AS trigger_enabled,
    to_regclass('django_migrations') IS NOT NULL AS recorder,
    to_regclass('outbox_notify_inbox_v1') IS NOT NULL AS inbox_table;

-- name: outbox_migrated
SELECT EXISTS (SELECT FROM django_migrations WHERE app = 'outbox_notify');

-- name: relay_privileges
-- One row per privilege the relay needs (sql/relay_role.sql grants exactly these); `held` is
-- NULL when the table does not exist. has_table_privilege() with a list of privileges is true
-- when any one is held, so each is asked for on its own. UPDATE is needed on the columns the
-- relay writes only (a table-wide grant holds them too): has_column_privilege() per column.
SELECT needed.tbl,
       needed.privilege || coalesce(' (' || needed.col || ')', ''),
       CASE WHEN needed.col IS NULL
            THEN has_table_privilege(to_regclass(needed.tbl), needed.privilege)
            ELSE has_column_privilege(to_regclass(needed.tbl), needed.col, needed.privilege)
       END
FROM (VALUES
    ('outbox_notify_message_v1', 'SELECT', NULL),
    ('outbox_notify_message_v1', 'UPDATE', 'retries'),
    ('outbox_notify_message_v1', 'UPDATE', 'retry_after'),
    ('outbox_notify_message_v1', 'UPDATE', 'last_error'),
    ('outbox_notify_message_v1', 'DELETE', NULL),
    ('outbox_notify_dead_letter_v1', 'INSERT', NULL),
    ('outbox_notify_frontier_v1', 'SELECT', NULL),
    ('outbox_notify_frontier_v1', 'INSERT', NULL),
    ('outbox_notify_frontier_v1', 'UPDATE', NULL),
    ('outbox_notify_sample_v1', 'SELECT', NULL),
    ('outbox_notify_sample_v1', 'INSERT', NULL),
    ('outbox_notify_sample_v1', 'DELETE', NULL)
) AS needed (tbl, privilege, col);
