"""The Cassandra keyspace and its tables, applied as numbered CQL migrations."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# A schema change waits for every table's flush and the schema's agreement: on a busy
# 2-core machine past the driver's 10 s (a test keyspace's migration failed so in CI).
SCHEMA_TIMEOUT_S = 60.0
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.cql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: list[str]


def discover(folder: Path = MIGRATIONS_DIR) -> list[Migration]:
    migrations = []
    for path in sorted(folder.glob("*.cql")):
        match = _NAME.match(path.name)
        if match is None:
            raise ValueError(f"migration {path.name} must be named NNNN_name.cql")
        migrations.append(Migration(int(match[1]), match[2], split_statements(path.read_text())))
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise ValueError(f"two migrations share a number: {versions}")
    return migrations


def split_statements(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]


def migrate(session: Any, keyspace: str, replication_factor: int = 1) -> list[str]:
    """Apply the migrations this keyspace has not seen; return the names applied now."""
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,47}", keyspace):
        raise ValueError(f"keyspace name {keyspace!r} is not a valid CQL identifier")
    run = partial(session.execute, timeout=SCHEMA_TIMEOUT_S)
    run(
        f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = "
        f"{{'class': 'SimpleStrategy', 'replication_factor': {replication_factor}}}"
    )
    session.set_keyspace(keyspace)
    run(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version int PRIMARY KEY, name text, applied_at timestamp)"
    )
    done = {row.version for row in run("SELECT version FROM schema_migrations")}
    applied = []
    for migration in discover():
        if migration.version in done:
            continue
        for statement in migration.statements:
            run(statement)
        run(
            "INSERT INTO schema_migrations (version, name, applied_at) "
            "VALUES (%s, %s, toTimestamp(now()))",
            (migration.version, migration.name),
        )
        applied.append(f"{migration.version:04d}_{migration.name}")
    return applied
