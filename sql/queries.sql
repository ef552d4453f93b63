-- Named queries of outbox-notify, loaded by outbox_notify.sql.queries().
-- Each section starts with a `-- name: NAME` line. Parameters use psycopg's %(name)s style.

-- name: insert_message
-- The write side: one row per message, in the caller's transaction.
INSERT INTO outbox_notify_message_v1
    (task_id, task_name, args, kwargs, options, context, schema_version)
VALUES
    (%(task_id)s, %(task_name)s, %(args)s::json, %(kwargs)s::json, %(options)s::json,
     %(context)s::json, %(schema_version)s);
