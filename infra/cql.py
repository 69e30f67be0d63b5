"""The Cassandra keyspace and its tables, applied as numbered CQL migrations."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from infra.errors import InfraError

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
    _check_replication(run, keyspace, replication_factor)
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


def _check_replication(run: Any, keyspace: str, wanted: int) -> None:
    """CREATE ... IF NOT EXISTS leaves a keyspace as it was made: one made with the
    default factor of 1 stayed at 1 after the setting became 3, each row on one node
    (lost with it), and bootstrap said nothing. Changed here it would be wrong too: rows
    written before read as missing at LOCAL_QUORUM until a repair copies them."""
    rows = run(
        "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s", (keyspace,)
    )
    replication = dict(rows.one().replication)
    have = replication.get("replication_factor")
    if have is not None and int(have) != wanted:
        raise InfraError(
            f"keyspace {keyspace} has replication_factor {have}, the settings say {wanted} "
            f"(TANDOOR_CASSANDRA_REPLICATION_FACTOR): run ALTER KEYSPACE {keyspace} WITH "
            f"replication = {{'class': 'SimpleStrategy', 'replication_factor': {wanted}}}, "
            "then `nodetool repair -full` on every node, or set the factor it has"
        )
