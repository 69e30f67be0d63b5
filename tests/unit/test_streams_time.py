"""Stream time, which decides what is late and what expires: a record from a clock far
ahead, a catch-up after an outage, a window expiring while it is published (the agents
in faust's test context, as in test_streams_agents.py)."""

from __future__ import annotations

import faust
import pytest

from schemas.codec import encode
from schemas.events import now_ms
from streams.app import rollup_tables
from streams.tables import CLOCK_AHEAD_MS, CLOSE_GRACE_MS
from tests.unit.test_rollups import final_event
from tests.unit.test_streams_agents import Sink, short_memory, usage  # noqa: F401
from tests.unit.test_streams_rebalance import rebalance, recover, table_contents


async def hours_behind_with_a_restart_of_now(app: faust.App) -> int:
    """The model side after an outage: usage of 3 hours ago, and a re-run's final of now
    (the token stream runs ahead); the hour the usage is at."""
    old = (now_ms() // 3_600_000 - 3) * 3_600_000
    restart = final_event("re-run", 2).model_copy(update={"created_at_ms": now_ms()})
    async with app.agents["rollups-by-model"].test_context() as agent:
        await agent.put(encode(usage("before", at=old)))
        await agent.put(encode(restart))
    return old


async def catch_up(app: faust.App, minute: int) -> None:
    """Three usage records of `minute`, forwarded per model as the usage catches up."""
    async with app.agents["rollups-by-model"].test_context() as agent:
        for i in range(3):
            await agent.put(encode(usage(f"caught-up{i}", at=minute + i)))


async def test_a_record_from_a_clock_far_ahead_does_not_expire_the_others(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
) -> None:
    """Stream time is the newest finish time: one record stamped a year ahead (a worker's
    clock gone wrong) dropped every window and counted id of its partition, so copies
    read after it were counted twice; and, counted in its own window a year ahead, its id
    held back the pruning of every id after it."""
    app, _ = short_memory
    tables = rollup_tables(app)
    now = now_ms()  # not the minute's start: up to 60 s old, past this app's 60 s of ids
    first, far = usage("a", at=now), usage("far", at=now + 365 * 86_400_000)
    async with app.agents["rollups-by-user"].test_context() as agent:
        for record in (first, far, first):  # then a copy of the first
            await agent.put(encode(record))
    minutes = [s for s in tables.summaries("user", "ada") or [] if s["window"] == "1m"]
    assert sum(s["requests"] for s in minutes) == 2, minutes  # the copy not counted again
    # Counted when it came, not in a window a year ahead that nothing would close.
    assert max(s["start_ms"] for s in minutes) <= now + CLOCK_AHEAD_MS, minutes
    assert tables.sizes()["counted-by-user"] <= 3  # its id expires with the others'


async def test_usage_caught_up_after_an_outage_counts_per_model_beside_a_recent_restart(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
) -> None:
    """Back after an outage, the token stream (scanned, not parsed) forwards a re-run's
    final of now while the forwarded usage is hours behind: the final moved the model
    side's stream time to now, and every usage record of a minute not yet made was
    passed over as late, counted per user and lost per model."""
    app, sink = short_memory
    old = await hours_behind_with_a_restart_of_now(app)
    await catch_up(app, old + 60_000)
    await rollup_tables(app).publish_changes()
    assert sink.rollups[f"model/smollm2/1m/{old + 60_000}"]["requests"] == 3
    assert sum(r["restarts"] for k, r in sink.rollups.items() if "/1m/" in k) == 1


async def test_ids_caught_up_behind_a_recent_restart_are_kept_only_as_long_as_the_others(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
) -> None:
    """Ids were dropped oldest-arrived first, and only while older than stream time less
    the dedupe span: the re-run's final of now, arrived first, held every caught-up usage
    id behind it, in memory and in the changelog, until stream time passed now."""
    app, _ = short_memory
    old = await hours_behind_with_a_restart_of_now(app)
    async with app.agents["rollups-by-model"].test_context() as agent:
        for i in range(200):  # 20 minutes of usage, a record every 6 s
            await agent.put(encode(usage(f"caught-up{i}", at=old + i * 6_000)))
    # 60 s of ids (short_memory) is about 10 records, and the re-run's own.
    assert rollup_tables(app).sizes()["counted-by-model"] <= 13


async def test_a_late_change_is_published_though_its_window_expires_while_it_is_sent(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
) -> None:
    """A late record changed a minute already published closed; while the timer sent
    the changes before it, the agent moved stream time past that minute's expiry and
    dropped it: the loop found it gone, and its last count never went out."""
    app, sink = short_memory
    tables = rollup_tables(app)
    old = (now_ms() // 3_600_000 - 3) * 3_600_000
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=old + 1_000)))
        await tables.publish_changes()  # the minute, published closed
        await agent.put(encode(usage("late", at=old + 2_000)))
        send = tables._publish

        async def publish_while_counting(key: bytes, value: bytes) -> None:
            tables._publish = send
            await agent.put(encode(usage("later", at=old + 600_000)))  # past its expiry
            await send(key, value)

        tables._publish = publish_while_counting
        await tables.publish_changes()
    assert sink.rollups[f"user/ada/1m/{old}"]["requests"] == 2


async def test_a_restart_of_the_app_mid_catch_up_does_not_make_the_usage_late_again(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
) -> None:
    """The tables rebuilt after a restart set stream time from every window they hold,
    a window only a re-run's final of now made too: the usage still catching up was
    passed over as late again, for the rest of the catch-up."""
    app, sink = short_memory
    old = await hours_behind_with_a_restart_of_now(app)
    (partition,) = {p for d, p in rollup_tables(app)._books if d == "model"}
    changelog = table_contents(app)
    await rebalance(app, set())  # the app stops, and starts again with its partition
    recover(app, changelog)
    await rebalance(app, {partition})
    await catch_up(app, old + 60_000)
    await rollup_tables(app).publish_changes()
    assert sink.rollups[f"model/smollm2/1m/{old + 60_000}"]["requests"] == 3


def quiet_rule_on_a_clock(app: faust.App, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The real rule for closing by the clock (only where nothing came for the grace),
    on a monotonic clock the test moves: [seconds]."""
    rollup_tables(app).quiet_s = CLOSE_GRACE_MS / 1000
    clock = [1_000.0]
    monkeypatch.setattr("streams.tables.monotonic", lambda: clock[0])
    return clock


async def test_a_partition_still_catching_up_closes_its_windows_by_its_records(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Minutes were closed by the clock on every partition: one still reading a backlog
    (after an outage, or behind its load) published each old minute "closed" with its
    first records, and "closed" again with each later count. The clock closes windows
    only where nothing came for the grace period."""
    app, sink = short_memory
    tables = rollup_tables(app)
    clock = quiet_rule_on_a_clock(app, monkeypatch)
    old = (now_ms() // 3_600_000 - 3) * 3_600_000
    first, second = f"user/ada/1m/{old}", f"user/ada/1m/{old + 60_000}"
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=old + 1_000)))
        await tables.publish_changes()
        assert (sink.rollups[first]["requests"], sink.rollups[first]["closed"]) == (1, False)
        await agent.put(encode(usage("b", at=old + 2_000)))
        await agent.put(encode(usage("c", at=old + 60_000 + CLOSE_GRACE_MS)))  # its end passed
        await tables.publish_changes()
        assert (sink.rollups[first]["requests"], sink.rollups[first]["closed"]) == (2, True)
        assert sink.rollups[second]["closed"] is False
        clock[0] += CLOSE_GRACE_MS / 1000  # nothing more came: the clock closes it
        await tables.publish_changes()
        assert (sink.rollups[second]["requests"], sink.rollups[second]["closed"]) == (1, True)


async def test_a_window_once_published_closed_is_never_published_open_again(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closed by the clock on a quiet partition, then changed by a late record (a copy a
    worker re-sent): published "closed": false, its last record, for good."""
    app, sink = short_memory
    tables = rollup_tables(app)
    clock = quiet_rule_on_a_clock(app, monkeypatch)
    old = (now_ms() // 3_600_000 - 3) * 3_600_000
    minute = f"user/ada/1m/{old}"
    async with app.agents["rollups-by-user"].test_context() as agent:
        await agent.put(encode(usage("a", at=old + 30_000)))
        clock[0] += CLOSE_GRACE_MS / 1000
        await tables.publish_changes()
        assert sink.rollups[minute]["closed"] is True
        await agent.put(encode(usage("late", at=old + 40_000)))
        await tables.publish_changes()
    assert (sink.rollups[minute]["requests"], sink.rollups[minute]["closed"]) == (2, True)


async def test_a_partition_just_taken_over_is_not_closed_by_the_clock_before_its_backlog(
    short_memory: tuple[faust.App, Sink],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart, its book new: a publication before the first record of its
    backlog was read closed the minute the crash cut short, with what it had then."""
    app, sink = short_memory
    tables = rollup_tables(app)
    old = await hours_behind_with_a_restart_of_now(app)
    (partition,) = {p for d, p in tables._books if d == "model"}
    changelog = table_contents(app)
    await rebalance(app, set())
    clock = quiet_rule_on_a_clock(app, monkeypatch)
    recover(app, changelog)
    await rebalance(app, {partition})
    sink.rollups.clear()
    await tables.publish_changes()  # before the backlog is read
    assert sink.rollups[f"model/smollm2/1m/{old}"]["closed"] is False
    clock[0] += CLOSE_GRACE_MS / 1000  # then nothing comes
    await tables.publish_changes()
    assert sink.rollups[f"model/smollm2/1m/{old}"]["closed"] is True
