"""The schema history is frozen: released migration files and row fixtures never change.

Adding a schema version (docs/install.md): write `sql/migrations/NNNN_name.sql` and
`NNNN_name.reverse.sql`, a Django migration `NNNN_name` that runs them, fold the change into
`sql/install.sql` and `sql/uninstall.sql`, and add the new files' checksums to RELEASED below.
While the migration is only under `## [Unreleased]` in the changelog its checksums may still
change; once a release ships it, never.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from django.db import migrations
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations.base import Operation

from outbox_notify import sql

REPO = Path(__file__).resolve().parents[2]
SQL_MIGRATIONS = REPO / "sql" / "migrations"
DJANGO_MIGRATIONS = REPO / "outbox_notify" / "migrations"
ROW_FIXTURES = REPO / "tests" / "schema_rows"  # rows as each schema_version's writer stored them

# sha256 of every released schema file, by path from the repository root.
RELEASED = {
    "sql/migrations/0001_initial.sql": "b8e9148c43f7bf350e7c4b38d8bc847a2d301744d09b791ea97dfba049541b74",
    "sql/migrations/0001_initial.reverse.sql": "1a8ec34a3e448b8a16f389cf7aaa1e17aca27f4f6af0e58f6709aac3bb5b511b",
    "tests/schema_rows/v1.json": "26d7e1e45498fdafc2be345f192c017b5eda8257558a73bfce226a2534e02fc1",
    "tests/schema_rows/v2.json": "ee296fa4a7c720cf2aa529e3eb5f23fb89739f4c714e4f2ee6844d5ca5d25a83",
    "tests/schema_rows/v3.json": "3aa16354b1ba552434de4782d316c7a34758ca3eb56240bc002f807f15773b3b",
    # The compact layout of a task (unreleased: may still change).
    "tests/schema_rows/v4.json": "da854585415037a9cb52b0793dd60d7fce039f4e4d7b34334dd2e8188061661a",
    "outbox_notify/migrations/0001_initial.py": "c4e53433b746550222622470e6806fcab928c14b72139c1902980b93fb702290",
    # State only (the models' Python defaults); runs no SQL.
    "outbox_notify/migrations/0002_model_defaults.py": "e17e4f6f6fa5a43e4edca979775381ea7048b4e3cd8bf48a6a1b0d559f09718e",
    # The "ready now" index for rows held until their ETA (unreleased: may still change).
    "sql/migrations/0003_held.sql": "bde31927662a1251cf393360b991dd49a4f693e4ab59189ce06f007824965284",
    "sql/migrations/0003_held.reverse.sql": "0e594d25caa50a37074668fbe04aca9946b4db8051f9c24a040cb47dd814eae1",
    "outbox_notify/migrations/0003_held.py": "38b952792e9fbb90592890d8552df294fc5fba45c0ad975476fb81ccaa5560f4",
    # The inbox of OnceTask (unreleased: may still change).
    "sql/migrations/0004_inbox.sql": "814106c919d2a24e13d5fde791b92bad561e306ab19120888fbf6275fe37f030",
    "sql/migrations/0004_inbox.reverse.sql": "d3df7204f4b1cad5a3fc7cd9bfb124940cf67238825aff0157ee15ba47d367cf",
    "outbox_notify/migrations/0004_inbox.py": "7620fa330c55b32293bc325ed2b23a9a3950df3dbb51bb88b6d4dce16b8db722",
    # Claims from the relay's frontier: txid, its restamping trigger, the indexes it reads
    # (unreleased: may still change).
    "sql/migrations/0005_frontier.sql": "9fe137f57703818c945007beb08ec67728b162342d7439f07113d2325c624818",
    "sql/migrations/0005_frontier.reverse.sql": "b0c4c721ed1f77b11eaad59591b42344e399d454ad6b95176f9d36d6eb6827f1",
    "outbox_notify/migrations/0005_frontier.py": "4400146723aed96ffad6d3cb4fc5ff3a2609405a7f23267473b5600e282cd614",
    # The relays' samples for the admin's Outbox dashboard (unreleased: may still change).
    "sql/migrations/0006_samples.sql": "abd6ecead3c9387e1e181a050b165217add15ae615fcc93682050bf91788ea30",
    "sql/migrations/0006_samples.reverse.sql": "40482c4f181da810f5041f23d78044593009ae7a8737319c32363054b0663993",
    "outbox_notify/migrations/0006_samples.py": "9fb0d71faa2cf7a7b1551e01ba0c9455a38f0d8e6b571c76cc221ac8c6a3de53",
    "outbox_notify/migrations/0007_dashboard_entry.py": "f8575e40c8cc6e4805fe3b42d5abf48151a9b4dd9eab24dc711d974f1eab081d",
}

EDITED = (
    "{path} differs from the released file (sha256 {actual}, released {expected}). A released "
    "migration is never edited: databases that already applied it would never see the change, "
    "and databases migrated later would differ from them. Restore the file (git checkout) and "
    "put the change in a new migration; see 'Adding a schema version' in docs/install.md."
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _schema_files() -> set[str]:
    sql_files = SQL_MIGRATIONS.glob("*.sql")
    django_files = DJANGO_MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py")
    row_fixtures = ROW_FIXTURES.glob("v*.json")
    return {str(p.relative_to(REPO)) for p in (*sql_files, *django_files, *row_fixtures)}


@pytest.mark.parametrize("path", sorted(RELEASED))
def test_released_schema_file_is_unchanged(path: str) -> None:
    """Each released migration file still has the checksum it was released with."""
    actual = _sha256(REPO / path)
    expected = RELEASED[path]
    assert actual == expected, EDITED.format(path=path, actual=actual, expected=expected)


def test_every_migration_file_is_registered() -> None:
    """Every migration file in the repository has its checksum in RELEASED, and none is gone."""
    missing = sorted(_schema_files() - set(RELEASED))
    gone = sorted(set(RELEASED) - _schema_files())
    checksums = {path: _sha256(REPO / path) for path in missing}
    assert missing == [], f"add these new files to RELEASED in {__file__}: {checksums}"
    assert gone == [], f"released migration files were deleted: {gone}; restore them"


def _database_operations(operations: list[Operation]) -> list[Operation]:
    """The operations that touch the database, SeparateDatabaseAndState unwrapped."""
    found: list[Operation] = []
    for operation in operations:
        if isinstance(operation, migrations.SeparateDatabaseAndState):
            found.extend(_database_operations(operation.database_operations))
        else:
            found.append(operation)
    return found


def _outbox_migrations() -> dict[str, migrations.Migration]:
    loader = MigrationLoader(None, load=True)
    return {
        name: migration
        for (app, name), migration in loader.disk_migrations.items()
        if app == "outbox_notify"
    }


def test_each_migration_runs_only_its_own_frozen_sql() -> None:
    """Migration NNNN_name changes the database only by running sql/migrations/NNNN_name.sql."""
    found = _outbox_migrations()
    assert "0001_initial" in found
    for name, migration in found.items():
        operations = _database_operations(list(migration.operations))
        assert all(isinstance(op, migrations.RunSQL) for op in operations), name
        run = [op for op in operations if isinstance(op, migrations.RunSQL)]
        forward = [op.sql for op in run]
        reverse = [op.reverse_sql for op in run]
        if (SQL_MIGRATIONS / f"{name}.sql").exists():
            assert forward == [sql.read(f"migrations/{name}.sql")], name
            assert reverse == [sql.read(f"migrations/{name}.reverse.sql")], name
        else:
            assert forward == [], f"{name} runs SQL that is not in sql/migrations/{name}.sql"
