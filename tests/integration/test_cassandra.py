"""Cassandra is real: migrations apply once, and a write is read back after the
driver reconnects."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator

import pytest
from cassandra.query import SimpleStatement

from infra.cql import migrate
from infra.errors import InfraError
from tandoor.clients import cassandra_session, cql, cql_pages
from tandoor.settings import Settings


@pytest.fixture
def keyspace(cassandra: Settings, unique: str) -> Iterator[str]:
    name = f"t_{unique}"
    yield name
    with cassandra_session(cassandra) as session:
        session.execute(f"DROP KEYSPACE IF EXISTS {name}")


def test_migrations_apply_once(cassandra: Settings, keyspace: str) -> None:
    with cassandra_session(cassandra) as session:
        assert migrate(session, keyspace) == [
            "0001_initial",
            "0002_api_keys",
            "0003_conversation_last_reply",
            "0004_batches",
            "0005_conversation_summary",
            "0006_files_and_batches",
            "0007_files_by_user",
            "0008_batch_summary",
            "0009_batch_metadata_given",
            "0010_batch_queuing",
            "0011_api_key_lookups",
            "0012_batch_output_answered_at",
        ]
        assert migrate(session, keyspace) == []
        rows = session.execute(
            "SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s", (keyspace,)
        )
        tables = {row.table_name for row in rows}
    assert {
        "schema_migrations",
        "conversations",
        "conversations_by_user",
        "messages_by_conversation",
        "usage_by_user_day",
        "api_keys",
        "files",
        "files_by_user",
        "file_chunks",
        "api_batches",
        "batches_by_user",
        "batch_outputs",
    } <= tables
    assert not {"batches", "batch_results"} & tables  # dropped with the old batch client


def test_a_keyspace_made_with_another_replication_factor_is_named_not_passed_over(
    cassandra: Settings, keyspace: str
) -> None:
    """Made with the default 1, the setting raised to 3 later: bootstrap kept it at 1
    (each row on one node, lost with it) and said nothing."""
    with cassandra_session(cassandra) as session:
        migrate(session, keyspace, replication_factor=1)
        with pytest.raises(InfraError, match="replication_factor 1, the settings say 2"):
            migrate(session, keyspace, replication_factor=2)
        assert migrate(session, keyspace, replication_factor=1) == []


def test_write_is_read_back_after_reconnect(cassandra: Settings, keyspace: str) -> None:
    at = dt.datetime(2026, 11, 29, 12, 0, 0, 123000)
    insert = (
        "INSERT INTO messages_by_conversation "
        "(conversation_id, created_at, message_id, role, content, status) "
        "VALUES (%s, %s, %s, %s, %s, %s)"
    )
    with cassandra_session(cassandra) as session:
        migrate(session, keyspace)
        session.execute(insert, ("c-1", at, "m-1", "user", "Hallo 👋", "complete"))
        # The same write again (a replay) must not add a row.
        session.execute(insert, ("c-1", at, "m-1", "user", "Hallo 👋", "complete"))

    with cassandra_session(cassandra, keyspace) as session:
        rows = list(
            session.execute(
                "SELECT message_id, content, created_at FROM messages_by_conversation "
                "WHERE conversation_id = %s",
                ("c-1",),
            )
        )
    assert [(r.message_id, r.content, r.created_at) for r in rows] == [("m-1", "Hallo 👋", at)]


async def test_sidebar_lists_newest_first(cassandra: Settings, keyspace: str) -> None:
    def write_and_list() -> list[str]:
        with cassandra_session(cassandra) as session:
            migrate(session, keyspace)
            for day, cid in ((1, "old"), (3, "newest"), (2, "middle")):
                session.execute(
                    "INSERT INTO conversations_by_user (user_id, updated_at, conversation_id) "
                    "VALUES (%s, %s, %s)",
                    ("alice", dt.datetime(2026, 11, day), cid),
                )
            rows = session.execute(
                "SELECT conversation_id FROM conversations_by_user WHERE user_id = %s",
                ("alice",),
            )
            return [row.conversation_id for row in rows]

    assert await asyncio.to_thread(write_and_list) == ["newest", "middle", "old"]


async def test_rows_are_read_a_page_at_a_time_the_next_once_asked_for(
    cassandra: Settings, keyspace: str
) -> None:
    """How a batch's output file is read: its 50,000 lines were held whole, and joined,
    for each download."""
    with cassandra_session(cassandra) as session:
        session.execute(
            f"CREATE KEYSPACE {keyspace} WITH replication = "
            "{'class': 'SimpleStrategy', 'replication_factor': 1}"
        )
        session.execute(f"CREATE TABLE {keyspace}.paged (k int, c int, PRIMARY KEY (k, c))")
        for c in range(7):
            session.execute(f"INSERT INTO {keyspace}.paged (k, c) VALUES (1, %s)", (c,))
        statement = SimpleStatement(f"SELECT c FROM {keyspace}.paged WHERE k = 1", fetch_size=3)
        pages = cql_pages(session, statement)
        assert [row.c for row in await anext(pages)] == [0, 1, 2]
        session.execute(f"INSERT INTO {keyspace}.paged (k, c) VALUES (1, 7)")  # asked after
        assert [[row.c for row in page] async for page in pages] == [[3, 4, 5], [6, 7]]
        assert [row.c for row in await cql(session, statement)] == list(range(8))
