"""The schema guards: models, migration and sql/install.sql describe one and the same schema.

Each comparison runs on databases created for the test on the session's server (and dropped
after it), so what `migrate` and `psql -f` build is seen from nothing, not on top of the
shared test database.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import models
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo

from outbox_notify.models import DeadLetter, InboxRecord, OutboxMessage

REPO = Path(__file__).resolve().parents[2]
INSTALL_SQL = REPO / "sql" / "install.sql"
UNINSTALL_SQL = REPO / "sql" / "uninstall.sql"
RELAY_ROLE_SQL = REPO / "sql" / "relay_role.sql"
PREFIX = "outbox_notify_"
VERSION = "_v1"
SUBPROCESS_TIMEOUT = 120.0  # seconds; a migrate takes about one

# UTF8 whatever the server's default: a SQL_ASCII database would hand text back as bytes.
CREATE_DATABASE = "CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C'"

Catalogue = dict[str, list[tuple[Any, ...]]]

# Everything in the schema except Django's own bookkeeping (django_migrations, its sequence,
# key and indexes), so an object a migration creates without our prefix is caught too.
_CATALOGUE_QUERIES = {
    "relations": r"""
        SELECT c.relname::text, c.relkind::text, c.relpersistence::text,
               c.reloptions::text, c.relacl::text, obj_description(c.oid, 'pg_class')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname NOT LIKE 'django\_migrations%'
        ORDER BY c.relname
    """,
    # The column's rank, not attnum: a column dropped by a migration leaves a gap in attnum.
    "columns": r"""
        SELECT c.relname::text,
               rank() OVER (PARTITION BY c.oid ORDER BY a.attnum)::int AS position,
               a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text,
               co.collname::text, a.attacl::text, col_description(c.oid, a.attnum)
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm')
          AND a.attnum > 0 AND NOT a.attisdropped AND c.relname NOT LIKE 'django\_migrations%'
        ORDER BY c.relname, position
    """,
    "sequences": r"""
        SELECT sequencename::text, data_type::text, start_value, min_value, max_value,
               increment_by, cycle, cache_size
        FROM pg_sequences
        WHERE schemaname = 'public' AND sequencename NOT LIKE 'django\_migrations%'
        ORDER BY sequencename
    """,
    "constraints": r"""
        SELECT cl.relname::text, co.conname::text, pg_get_constraintdef(co.oid)
        FROM pg_constraint co
        JOIN pg_class cl ON cl.oid = co.conrelid
        JOIN pg_namespace n ON n.oid = cl.relnamespace
        WHERE n.nspname = 'public' AND cl.relname NOT LIKE 'django\_migrations%'
        ORDER BY cl.relname, co.conname
    """,
    "indexes": r"""
        SELECT tablename::text, indexname::text, indexdef
        FROM pg_indexes
        WHERE schemaname = 'public' AND tablename NOT LIKE 'django\_migrations%'
        ORDER BY tablename, indexname
    """,
    "triggers": """
        SELECT c.relname::text, t.tgname::text, pg_get_triggerdef(t.oid), t.tgenabled::text
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND NOT t.tgisinternal
        ORDER BY c.relname, t.tgname
    """,
    "functions": """
        SELECT p.proname::text, pg_get_function_identity_arguments(p.oid),
               pg_get_functiondef(p.oid), p.proacl::text, obj_description(p.oid, 'pg_proc')
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public'
        ORDER BY p.proname, 2
    """,
    "types": """
        SELECT t.typname::text, t.typtype::text, format_type(t.typbasetype, t.typtypmod)
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        -- Not the row types of tables nor array types: those follow the relations above.
        WHERE n.nspname = 'public' AND t.typrelid = 0 AND t.typcategory <> 'A'
        ORDER BY t.typname
    """,
}


def _connect(server_url: str, dbname: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(server_url, dbname=dbname, autocommit=True)


@pytest.fixture
def fresh_database(pg_server_url: str) -> Iterator[Callable[[], str]]:
    """Creates empty databases with unique names on the session's server; drops them after."""
    created: list[str] = []

    def create() -> str:
        name = f"outbox_schema_{uuid.uuid4().hex[:12]}"
        with _connect(pg_server_url, "postgres") as admin:
            admin.execute(pgsql.SQL(CREATE_DATABASE).format(pgsql.Identifier(name)))
        created.append(name)
        return name

    try:
        yield create
    finally:
        with _connect(pg_server_url, "postgres") as admin:
            for name in created:
                admin.execute(
                    pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        pgsql.Identifier(name)
                    )
                )


def _psql_install(server_url: str, dbname: str) -> None:
    """`psql -f sql/install.sql` against `dbname`, as a DBA would."""
    _psql_file(server_url, dbname, INSTALL_SQL)


def _psql_file(server_url: str, dbname: str, path: Path) -> None:
    """`psql -f path` against `dbname`, stopping at the first error."""
    conninfo = make_conninfo(server_url, dbname=dbname)
    argv = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", conninfo, "-f", str(path)]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False
    )
    assert result.returncode == 0, result.stderr


def _migrate(server_url: str, dbname: str, *target: str) -> None:
    """`python -m django migrate outbox_notify [target]` against `dbname`, as a user would."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        OUTBOX_TEST_DATABASE_URL=server_url,
        OUTBOX_TEST_DB_NAME=dbname,
        PYTHONPATH=str(REPO),
    )
    result = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "outbox_notify", *target, "--no-input"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _catalogue(server_url: str, dbname: str) -> Catalogue:
    """Relations, columns, sequences, constraints, indexes, triggers, functions, types, grants."""
    with _connect(server_url, dbname) as conn:
        return {kind: conn.execute(query).fetchall() for kind, query in _CATALOGUE_QUERIES.items()}


def _names(rows: list[tuple[Any, ...]], column: int = 0) -> set[str]:
    return {str(row[column]) for row in rows}


@pytest.mark.django_db(databases=["default", "other"])
def test_models_need_no_new_migration() -> None:
    """makemigrations --check finds nothing: the models and the migration state agree."""
    # django_db: makemigrations checks the applied-migration history on every alias.
    out = io.StringIO()
    call_command("makemigrations", "outbox_notify", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def test_migrate_builds_exactly_the_schema_of_install_sql(
    pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """`migrate` (every frozen migration) and `psql -f sql/install.sql` build the same schema."""
    # The same catalogue on both sides: relations, columns with types and defaults, sequences,
    # constraints, indexes, triggers, functions, and the grants relay_role.sql makes on them.
    by_psql, by_migrate = fresh_database(), fresh_database()
    _psql_install(pg_server_url, by_psql)
    _migrate(pg_server_url, by_migrate)
    for dbname in (by_psql, by_migrate):
        _psql_file(pg_server_url, dbname, RELAY_ROLE_SQL)
    expected = _catalogue(pg_server_url, by_psql)
    assert _names(expected["columns"]) == {
        "outbox_notify_message_v1",
        "outbox_notify_dead_letter_v1",
        "outbox_notify_inbox_v1",
        "outbox_notify_frontier_v1",
        "outbox_notify_sample_v1",
    }
    assert _names(expected["triggers"], 1) == {"outbox_notify_wake_v1", "outbox_notify_restamp_v1"}
    assert "outbox_notify_relay" in str(expected["relations"])
    assert _catalogue(pg_server_url, by_migrate) == expected


def test_uninstall_sql_removes_everything_install_sql_creates(
    pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """`psql -f sql/uninstall.sql` after install.sql leaves no table, function, trigger or type."""
    dbname = fresh_database()
    _psql_install(pg_server_url, dbname)
    assert _catalogue(pg_server_url, dbname)["relations"] != []
    _psql_file(pg_server_url, dbname, UNINSTALL_SQL)
    assert _catalogue(pg_server_url, dbname) == {kind: [] for kind in _CATALOGUE_QUERIES}


def _table_columns(server_url: str, dbname: str, table: str) -> dict[str, bool]:
    """{column: nullable} of one table."""
    with _connect(server_url, dbname) as conn:
        rows = conn.execute(
            "SELECT column_name::text, is_nullable = 'YES' FROM information_schema.columns"
            " WHERE table_schema = 'public' AND table_name = %s",
            [table],
        ).fetchall()
    return {name: nullable for name, nullable in rows}


# Columns the database fills in itself and no model declares: Django would write them (4.2
# has no db_default), and only the relay reads them.
DATABASE_ONLY = {"outbox_notify_message_v1": {"txid": False}}


@pytest.mark.parametrize(
    "model", [OutboxMessage, DeadLetter, InboxRecord], ids=lambda m: m.__name__
)
def test_models_map_onto_the_sql_tables(
    model: type[models.Model], pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """Each model's columns and their nullability are exactly those install.sql creates."""
    dbname = fresh_database()
    _psql_install(pg_server_url, dbname)
    from_sql = _table_columns(pg_server_url, dbname, model._meta.db_table)
    from_model = {field.column: field.null for field in model._meta.concrete_fields}
    assert {**from_model, **DATABASE_ONLY.get(model._meta.db_table, {})} == from_sql


def test_migrate_zero_removes_everything_and_migrating_again_restores_it(
    pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """`migrate outbox_notify zero` drops every outbox table, function, trigger; forward again works."""
    dbname, reference = fresh_database(), fresh_database()
    _psql_install(pg_server_url, reference)
    _migrate(pg_server_url, dbname)
    _migrate(pg_server_url, dbname, "zero")
    assert _catalogue(pg_server_url, dbname) == {kind: [] for kind in _CATALOGUE_QUERIES}
    _migrate(pg_server_url, dbname)
    assert _catalogue(pg_server_url, dbname) == _catalogue(pg_server_url, reference)


def test_a_psql_install_faked_to_the_last_migration_then_migrates_cleanly(
    pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """install.md's DBA path: psql install.sql, `migrate outbox_notify <last> --fake`, migrate."""
    last = sorted(p.stem for p in (REPO / "outbox_notify" / "migrations").glob("[0-9]*.py"))[-1]
    by_hand, reference = fresh_database(), fresh_database()
    _psql_install(pg_server_url, by_hand)
    _psql_install(pg_server_url, reference)
    _migrate(pg_server_url, by_hand, last, "--fake")
    _migrate(pg_server_url, by_hand)  # nothing left to run: no table created twice
    assert _catalogue(pg_server_url, by_hand) == _catalogue(pg_server_url, reference)


def _migrations() -> list[str]:
    return sorted(p.stem for p in (REPO / "outbox_notify" / "migrations").glob("[0-9]*.py"))


@pytest.mark.parametrize("target", _migrations()[:-1])
def test_migrating_back_gives_the_schema_of_migrating_forward_to_the_same_point(
    target: str, pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """`migrate outbox_notify N` from the latest undoes exactly what came after N; forward again works."""
    dbname, reference = fresh_database(), fresh_database()
    _migrate(pg_server_url, reference, target)
    _migrate(pg_server_url, dbname)
    full = _catalogue(pg_server_url, dbname)
    _migrate(pg_server_url, dbname, target)
    assert _catalogue(pg_server_url, dbname) == _catalogue(pg_server_url, reference)
    _migrate(pg_server_url, dbname)
    assert _catalogue(pg_server_url, dbname) == full


_OBJECTS_QUERY = """
    SELECT 'relation ' || c.relkind::text, c.relname, coalesce(owner.relname, c.relname)
    FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_index i ON i.indexrelid = c.oid
    LEFT JOIN pg_depend d ON d.objid = c.oid AND d.classid = 'pg_class'::regclass
        AND d.deptype IN ('a', 'i') AND c.relkind = 'S'
    LEFT JOIN pg_class owner ON owner.oid = coalesce(i.indrelid, d.refobjid)
    WHERE n.nspname = 'public'
  UNION ALL
    SELECT 'constraint', co.conname, cl.relname
    FROM pg_constraint co
    JOIN pg_class cl ON cl.oid = co.conrelid
    JOIN pg_namespace n ON n.oid = co.connamespace
    WHERE n.nspname = 'public'
  UNION ALL
    SELECT 'function', p.proname, p.proname
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = 'public'
  UNION ALL
    SELECT 'type', t.typname, t.typname
    FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
    -- Not the row types of tables nor array types: those follow the relations above.
    WHERE n.nspname = 'public' AND t.typrelid = 0 AND t.typcategory <> 'A'
  UNION ALL
    SELECT 'trigger', t.tgname, t.tgname
    FROM pg_trigger t
    JOIN pg_class c ON c.oid = t.tgrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND NOT t.tgisinternal
"""

# A versioned name: the prefix, words, then the version as the last word.
_VERSIONED = re.compile(rf"^{PREFIX}[a-z0-9_]+{VERSION}$")


def test_every_object_of_install_sql_is_prefixed_and_versioned(
    pg_server_url: str, fresh_database: Callable[[], str]
) -> None:
    """Tables, functions, triggers are `outbox_notify_*_v1`; indexes, keys, sequences extend those names."""
    # Indexes, constraints and identity sequences are named after their table
    # (`outbox_notify_message_v1_task_id_idx`), so they carry the prefix and the version of
    # that table's name rather than ending in `_v1` themselves.
    dbname = fresh_database()
    _psql_install(pg_server_url, dbname)
    with _connect(pg_server_url, dbname) as conn:
        objects = conn.execute(_OBJECTS_QUERY).fetchall()
    kinds = {kind for kind, _, _ in objects}
    assert {"relation r", "relation i", "relation S", "constraint", "function", "trigger"} <= kinds
    unversioned = [
        (kind, name)
        for kind, name, owner in objects
        if not _VERSIONED.match(owner) or not (name == owner or name.startswith(owner + "_"))
    ]
    assert unversioned == []
