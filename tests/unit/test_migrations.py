from __future__ import annotations

from pathlib import Path

import pytest

from infra.cql import discover, split_statements


def test_shipped_migrations_are_numbered_and_parse() -> None:
    migrations = discover()
    assert [m.version for m in migrations] == sorted(m.version for m in migrations)
    assert migrations[0].version == 1
    tables = " ".join(" ".join(m.statements) for m in migrations)
    for table in ("conversations_by_user", "messages_by_conversation", "usage_by_user_day"):
        assert f"CREATE TABLE IF NOT EXISTS {table}" in tables


def test_statements_split_without_comments() -> None:
    text = "-- a comment; with a semicolon\nCREATE TABLE a (x int PRIMARY KEY);\n\nDROP TABLE b;\n"
    assert split_statements(text) == ["CREATE TABLE a (x int PRIMARY KEY)", "DROP TABLE b"]


def test_badly_named_migration_is_refused(tmp_path: Path) -> None:
    (tmp_path / "init.cql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="NNNN_name"):
        discover(tmp_path)


def test_duplicate_migration_numbers_are_refused(tmp_path: Path) -> None:
    (tmp_path / "0001_a.cql").write_text("SELECT 1;")
    (tmp_path / "0001_b.cql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="share a number"):
        discover(tmp_path)
