"""What a rebalance (or a restart) does to the publication of rollups: every window of a
partition this member owns is published, and published closed once it ends, whether or
not a record arrives after; a partition another member took is left to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import faust
import pytest
from faust.types import TP

from schemas.codec import encode
from schemas.events import now_ms
from streams.app import rollup_tables
from tests.unit.test_streams_agents import Sink, unit_app, usage


@pytest.fixture
def app_and_sink() -> Iterator[tuple[faust.App, Sink]]:
    with unit_app() as made:
        yield made


async def rebalance(app: faust.App, partitions: set[int]) -> None:
    """What faust does when a rebalance leaves this member `partitions` of each table:
    the revoke signal, then, once the tables are recovered, their recovery callbacks."""
    await app.on_partitions_revoked.send(set())
    actives = {
        TP(table.changelog_topic.get_topic_name(), partition)
        for table in app.tables.values()
        for partition in partitions
    }
    with mock.patch.object(app.assignor, "assigned_actives", return_value=actives):
        for table in app.tables.values():
            await table.call_recover_callbacks()


def table_contents(app: faust.App) -> dict[str, dict[Any, Any]]:
    """What each table's changelog holds (here: what the table held when it was read)."""
    tables: dict[str, Any] = dict(app.tables.items())  # faust's types hide `data`
    return {name: dict(table.data.items()) for name, table in tables.items()}


def recover(app: faust.App, changelog: dict[str, dict[Any, Any]]) -> None:
    """What faust's recovery does on a member that gets a partition: read the changelog
    into the table's store (no changelog written)."""
    for name, entries in changelog.items():
        table: Any = app.tables[name]
        table.data.update(entries)


async def count_one_record_minutes_ago(app: faust.App) -> tuple[int, int]:
    """A record of ada's in a minute that ended 4 minutes ago: (its minute, its partition)."""
    minutes_ago = (now_ms() // 60_000 - 5) * 60_000
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=minutes_ago)))
    return minutes_ago, next(iter(rollup_tables(app)._books))[1]


async def test_a_change_not_yet_published_is_published_closed_after_a_rebalance(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """The books were dropped on every revoke: what had changed since the last
    publication was never published, and a partition without a new record had no book,
    so its windows were never published closed."""
    app, sink = app_and_sink
    minutes_ago, partition = await count_one_record_minutes_ago(app)
    await rebalance(app, {partition})  # kept: the partition stays quiet after it
    await rollup_tables(app).publish_changes()
    minute = sink.rollups[f"user/ada/1m/{minutes_ago}"]
    assert minute["requests"] == 1 and minute["closed"], minute


async def test_a_window_published_closed_is_not_published_again_when_its_partition_stays(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, sink = app_and_sink
    _, partition = await count_one_record_minutes_ago(app)
    assert await rollup_tables(app).publish_changes() == 2  # the minute, closed; its hour
    sink.rollups.clear()
    await rebalance(app, {partition})
    assert await rollup_tables(app).publish_changes() == 0, sink.rollups


async def test_a_partition_another_member_took_is_not_published_here(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    app, sink = app_and_sink
    _, partition = await count_one_record_minutes_ago(app)
    await rebalance(app, {partition + 1})
    assert await rollup_tables(app).publish_changes() == 0
    assert sink.rollups == {}


async def test_nothing_is_published_between_a_revoke_and_the_recovery_that_says_what_stays(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """Its new owner may count the partition meanwhile: this member's closing publication
    of a window, with the count it had at the revoke, could land last and end the
    window with fewer than were counted."""
    app, sink = app_and_sink
    minutes_ago, partition = await count_one_record_minutes_ago(app)
    await app.on_partitions_revoked.send({TP("usage", partition)})
    assert await rollup_tables(app).publish_changes() == 0
    assert sink.rollups == {}
    await rebalance(app, {partition})  # kept after all
    assert await rollup_tables(app).publish_changes() == 2
    assert sink.rollups[f"user/ada/1m/{minutes_ago}"]["closed"]


class RevokedAtFirstSend(dict[str, Any]):
    """Rollups as published, the partition revoked while the first send waited."""

    def __init__(self, app: faust.App) -> None:
        super().__init__()
        self.app = app

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        for book in rollup_tables(self.app)._books.values():
            book.suspended = True  # as the revoke signal does


async def test_a_revoke_during_a_publication_stops_it_before_the_next_window(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """The suspension was looked at once a partition: a publication under way when the
    revoke came sent the rest of that partition's windows."""
    app, sink = app_and_sink
    minutes_ago, partition = await count_one_record_minutes_ago(app)
    sink.rollups = RevokedAtFirstSend(app)
    assert await rollup_tables(app).publish_changes() == 1  # the minute or its hour
    await rebalance(app, {partition})
    assert await rollup_tables(app).publish_changes() == 1  # the other, once kept
    assert sink.rollups[f"user/ada/1m/{minutes_ago}"]["closed"]


async def test_windows_that_expired_unpublished_are_published_after_their_partition_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A catch-up (usage hours old) expires minutes faster than the publish timer runs:
    their final figures were kept only in memory, and a rebalance (or a restart) before
    the next tick lost them: those minutes were never published."""
    monkeypatch.setattr("streams.tables.HOUSEKEEP_EVERY_S", 0.0)
    with unit_app(streams_retention_windows=2) as (app, sink):
        old = (now_ms() // 3_600_000 - 3) * 3_600_000
        async with app.agents["rollups-by-user"].test_context() as agent:
            for minute in range(10):
                await agent.put(encode(usage(f"r{minute}", at=old + minute * 60_000)))
        (_, partition), *_ = rollup_tables(app)._books
        changelog = table_contents(app)
        await rebalance(app, set())  # taken by another member...
        recover(app, changelog)  # ...which recovers the table (here: this one)
        await rebalance(app, {partition})
        await rollup_tables(app).publish_changes()
    minutes = [r for key, r in sink.rollups.items() if "/1m/" in key]
    assert len(minutes) == 10, minutes
    assert all(m["requests"] == 1 and m["closed"] for m in minutes), minutes


async def test_a_partition_another_member_took_leaves_nothing_here(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """faust's memory store forgets, on a rebalance, the entries it recovered, not those
    written here: they stayed, served by /rollups as if current, and held memory until
    the process ended; dropping them must not erase them from the changelog."""
    app, _ = app_and_sink
    await count_one_record_minutes_ago(app)
    tables = rollup_tables(app)
    assert len(tables.summaries("user", "ada") or []) == 2  # the minute and the hour
    assert (tables.sizes()["rollups-by-user"], tables.sizes()["counted-by-user"]) == (2, 1)
    with mock.patch.object(faust.Table, "send_changelog") as sent:
        await rebalance(app, set())
    assert tables.summaries("user", "ada") == []
    assert tables.sizes() == {name: 0 for name in tables.sizes()}
    sent.assert_not_called()


async def test_a_partition_taken_and_given_back_is_rebuilt_from_its_changelog(
    app_and_sink: tuple[faust.App, Sink],
) -> None:
    """The books of every partition this member gets are made in one walk of the
    tables; each holds that partition's windows and counted ids, not another's."""
    app, sink = app_and_sink
    minutes_ago, partition = await count_one_record_minutes_ago(app)
    changelog = table_contents(app)
    await rebalance(app, set())
    recover(app, changelog)
    await rebalance(app, {partition, partition + 1})
    tables = rollup_tables(app)
    book, other = tables._books[("user", partition)], tables._books[("user", partition + 1)]
    assert len(book.windows) == 2 and [i for _, i in book.counted] == [b"a"]
    assert not other.windows and not other.counted
    await tables.publish_changes()
    assert sink.rollups[f"user/ada/1m/{minutes_ago}"]["requests"] == 1
